"""Routes rollout requests to engines: least outstanding requests, one engine per group.

Which engines may take requests is not the router's to decide: it asks the fleet's
``Membership`` (rollout_fleet/membership.py) on every request, and keeps only what
routing itself needs - requests outstanding and groups pinned per engine:

- A *group* (the n samples of one prompt) is pinned to one engine on its first
  request, so the engine's prefix cache computes the prompt's KV once.
- A new group goes to the routable engine with the fewest requests in flight
  (ties: fewest pinned groups, then name), which balances engines of unequal
  speed without knowing their speed.
- Routable: READY engines, else SUSPECT ones (``Membership.routable``). A group
  pinned to an engine that stops being READY is re-pinned on its next request;
  an engine that stops serving (needs weights, draining, dead) loses its pins.

Thread-safe (one lock): the fleet's health checks and the worker's event loop
may run on different threads. Left out: weighting by KV-cache occupancy or
queue depth reported by the engines (SGLang's cache-aware router does this).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fleetrl.log import get_logger
from rollout_fleet.membership import (
    SERVING,
    EngineStatus,
    Membership,
    MembershipEvent,
    UnknownEngineError,
)

log = get_logger(__name__)

__all__ = ["Lease", "Router", "UnknownEngineError"]


@dataclass(frozen=True)
class Lease:
    """One request routed to ``engine``; hand it back with ``Router.release``.

    ``incarnation`` tells a restarted engine (same name, new process) from the
    one the request went to, so a late release cannot skew the new one's count.
    """

    engine: str
    incarnation: int
    count: int = 1  # samples in the request (a group's batched first piece: n)


@dataclass
class _Load:
    incarnation: int
    outstanding: int = 0
    groups: set[str] = field(default_factory=set)
    requests_routed: int = 0


class Router:
    """Least-outstanding-requests routing with group affinity over the membership's engines."""

    def __init__(self, membership: Membership | None = None) -> None:
        self.membership = membership if membership is not None else Membership()
        self._lock = threading.Lock()
        self._load: dict[str, _Load] = {}
        self._group_engine: dict[str, str] = {}
        self.membership.subscribe(self._on_event)

    # ---- queries --------------------------------------------------------------------------

    def state(self, name: str) -> EngineStatus:
        return self.membership.status(name)

    def outstanding(self, name: str) -> int:
        self.membership.status(name)  # unknown engine: a clear error
        with self._lock:
            load = self._load.get(name)
            return load.outstanding if load is not None else 0

    def routable(self) -> list[str]:
        """Engines a new request may go to now (ready ones, else suspect ones)."""
        return [name for name, _, _ in self.membership.routable()]

    def engine_of(self, group_id: str) -> str | None:
        with self._lock:
            return self._group_engine.get(group_id)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per-engine state (the membership's), outstanding requests, pinned groups and
        requests routed."""
        out = self.membership.snapshot()
        with self._lock:
            for name, row in out.items():
                load = self._load.get(name)
                if load is None or load.incarnation != row["incarnation"]:
                    load = _Load(int(row["incarnation"]))  # type: ignore[arg-type]
                row.update(
                    outstanding=load.outstanding,
                    groups=len(load.groups),
                    requests_routed=load.requests_routed,
                )
        return out

    # ---- routing --------------------------------------------------------------------------

    def acquire(self, group_id: str, count: int = 1) -> Lease | None:
        """Pick the engine for the next request of ``group_id`` and count it as outstanding
        (``count`` samples: a batched request counts as its samples do).

        Returns None when no engine is routable. Every lease must be handed back
        with one ``release(lease)``, however the request ended.
        """
        routable = self.membership.routable()
        if not routable:
            return None
        with self._lock:
            # routable: every READY engine, or (none ready) every SUSPECT one; a group
            # pinned to an engine outside that set moves
            candidates = {name: self._load_of(name, inc) for name, inc, _ in routable}
            pinned = self._group_engine.get(group_id)
            if pinned is not None and pinned not in candidates:
                self._unpin(group_id)
                pinned = None
            if pinned is None:
                pinned = min(
                    candidates,
                    key=lambda n: (candidates[n].outstanding, len(candidates[n].groups), n),
                )
                candidates[pinned].groups.add(group_id)
                self._group_engine[group_id] = pinned
            load = candidates[pinned]
            load.outstanding += count
            load.requests_routed += 1
            return Lease(pinned, load.incarnation, count)

    def release(self, lease: Lease) -> None:
        """The request of ``lease`` finished (in any way)."""
        with self._lock:
            load = self._load.get(lease.engine)
            if load is not None and load.incarnation == lease.incarnation:
                load.outstanding = max(0, load.outstanding - lease.count)

    def finish_group(self, group_id: str) -> None:
        """The group is done: drop its pin."""
        with self._lock:
            self._unpin(group_id)

    # ---- internals ------------------------------------------------------------------------

    def _load_of(self, name: str, incarnation: int) -> _Load:
        load = self._load.get(name)
        if load is None or load.incarnation != incarnation:  # a new process: fresh counts
            load = self._load[name] = _Load(incarnation)
        return load

    def _unpin(self, group_id: str) -> None:
        name = self._group_engine.pop(group_id, None)
        load = self._load.get(name) if name is not None else None
        if load is not None:
            load.groups.discard(group_id)

    def _on_event(self, event: MembershipEvent) -> None:
        """An engine that stops serving loses its pins (its groups move on their next request)."""
        if event.status in SERVING and not event.removed:
            return
        with self._lock:
            load = self._load.get(event.name)
            if load is None:
                return
            for group_id in load.groups:
                if self._group_engine.get(group_id) == event.name:
                    del self._group_engine[group_id]
            load.groups.clear()
            if event.removed:
                del self._load[event.name]
