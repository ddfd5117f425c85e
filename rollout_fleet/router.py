"""Routes rollout requests to engines: least outstanding requests, one engine per group.

The router is the fleet's registry of engines (name -> URL, state) and the
single place that decides which engine serves a request:

- A *group* (the n samples of one prompt) is pinned to one engine on its first
  request, so the engine's prefix cache computes the prompt's KV once.
- A new group goes to the routable engine with the fewest requests in flight
  (ties: fewest pinned groups, then name), which balances engines of unequal
  speed without knowing their speed.
- Engine states: ``starting`` (launched, weights not yet loaded: never routed
  to), ``ready``, ``suspect`` (a request failed: routed to only when no ready
  engine exists, and ready again after ``suspect_cooldown_s`` unless the fleet
  says otherwise), ``dead``. A group pinned to an engine that stops being ready
  is re-pinned on its next request.
- Listeners (the rollout worker) are told of every state change, so requests in
  flight on an engine that was just declared dead can be cancelled and
  regenerated elsewhere. Listeners are called on the thread that made the
  change, outside the router's lock.

Thread-safe (one lock): the fleet's health checks and the worker's event loop
may run on different threads. Left out: weighting by KV-cache occupancy or
queue depth reported by the engines (SGLang's cache-aware router does this).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetrl.log import get_logger

log = get_logger(__name__)


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    SUSPECT = "suspect"
    DEAD = "dead"
    REMOVED = "removed"


class UnknownEngineError(KeyError):
    """An engine name the router does not know."""

    def __str__(self) -> str:
        return f"unknown engine {self.args[0]!r}"


@dataclass(frozen=True)
class EngineEvent:
    """One state change of one engine, as told to listeners."""

    name: str
    state: EngineState
    url: str
    reason: str = ""


@dataclass(frozen=True)
class Lease:
    """One request routed to ``engine``; hand it back with ``Router.release``.

    ``incarnation`` tells a restarted engine (same name, new process) from the
    one the request went to, so a late release cannot skew the new one's count.
    """

    engine: str
    incarnation: int


@dataclass
class _Engine:
    name: str
    url: str
    state: EngineState
    incarnation: int
    outstanding: int = 0
    groups: set[str] = field(default_factory=set)
    suspect_since: float = 0.0
    requests_routed: int = 0


class Router:
    """Least-outstanding-requests routing with group affinity over a changing set of engines."""

    def __init__(
        self, *, suspect_cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ):
        if suspect_cooldown_s < 0:
            raise ValueError(f"suspect_cooldown_s must be >= 0, got {suspect_cooldown_s}")
        self._suspect_cooldown_s = suspect_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}
        self._group_engine: dict[str, str] = {}
        self._listeners: list[Callable[[EngineEvent], None]] = []
        self._incarnations = 0

    # ---- registry -------------------------------------------------------------------------

    def add_engine(self, name: str, url: str = "", *, ready: bool = True) -> None:
        """Register (or re-register after a restart) an engine; ``ready=False`` = starting."""
        state = EngineState.READY if ready else EngineState.STARTING
        with self._lock:
            old = self._engines.get(name)
            if old is not None and old.state not in (EngineState.DEAD, EngineState.REMOVED):
                raise ValueError(
                    f"engine {name!r} is already registered ({old.state}); mark it dead first"
                )
            self._incarnations += 1
            self._engines[name] = _Engine(
                name=name, url=url, state=state, incarnation=self._incarnations
            )
        log.info("engine %s added (%s) at %s", name, state, url or "<no url>")
        self._notify(EngineEvent(name, state, url, "added"))

    def remove_engine(self, name: str) -> None:
        """Forget an engine (scale-down); its pinned groups move on their next request."""
        with self._lock:
            engine = self._get(name)
            del self._engines[name]
            self._unpin_all(engine)
        log.info("engine %s removed", name)
        self._notify(EngineEvent(name, EngineState.REMOVED, engine.url, "removed"))

    def mark_ready(self, name: str, url: str | None = None) -> None:
        """The engine serves current weights: route to it."""
        self._set_state(name, EngineState.READY, "ready", url)

    def mark_suspect(self, name: str, reason: str = "") -> None:
        """A request to the engine failed; prefer other engines until it is cleared."""
        self._set_state(name, EngineState.SUSPECT, reason, only_from=EngineState.READY)

    def mark_dead(self, name: str, reason: str = "") -> None:
        """The engine is gone: never route to it; listeners cancel its requests in flight."""
        self._set_state(name, EngineState.DEAD, reason)

    def subscribe(self, listener: Callable[[EngineEvent], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[EngineEvent], None]) -> None:
        self._listeners.remove(listener)

    # ---- queries --------------------------------------------------------------------------

    def state(self, name: str) -> EngineState:
        with self._lock:
            return self._get(name).state

    def url(self, name: str) -> str:
        with self._lock:
            return self._get(name).url

    def outstanding(self, name: str) -> int:
        with self._lock:
            return self._get(name).outstanding

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._engines)

    def routable(self) -> list[str]:
        """Engines a new request may go to now (ready ones, else suspect ones)."""
        with self._lock:
            return [e.name for e in self._candidates()]

    def engine_of(self, group_id: str) -> str | None:
        with self._lock:
            return self._group_engine.get(group_id)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per-engine state, outstanding requests, pinned groups and requests routed."""
        with self._lock:
            return {
                e.name: {
                    "state": str(e.state),
                    "url": e.url,
                    "outstanding": e.outstanding,
                    "groups": len(e.groups),
                    "requests_routed": e.requests_routed,
                }
                for e in self._engines.values()
            }

    # ---- routing --------------------------------------------------------------------------

    def acquire(self, group_id: str) -> Lease | None:
        """Pick the engine for the next request of ``group_id`` and count it as outstanding.

        Returns None when no engine is routable. Every lease must be handed back
        with one ``release(lease)``, however the request ended.
        """
        with self._lock:
            candidates = self._candidates()
            if not candidates:
                return None
            pinned = self._group_engine.get(group_id)
            engine = self._engines.get(pinned) if pinned is not None else None
            if (
                engine is None
                or engine not in candidates
                or (
                    engine.state is not EngineState.READY
                    and any(c.state is EngineState.READY for c in candidates)
                )
            ):
                if engine is not None:
                    engine.groups.discard(group_id)
                engine = min(candidates, key=lambda e: (e.outstanding, len(e.groups), e.name))
                engine.groups.add(group_id)
                self._group_engine[group_id] = engine.name
            engine.outstanding += 1
            engine.requests_routed += 1
            return Lease(engine.name, engine.incarnation)

    def release(self, lease: Lease) -> None:
        """The request of ``lease`` finished (in any way)."""
        with self._lock:
            engine = self._engines.get(lease.engine)
            if engine is not None and engine.incarnation == lease.incarnation:
                engine.outstanding = max(0, engine.outstanding - 1)

    def finish_group(self, group_id: str) -> None:
        """The group is done: drop its pin."""
        with self._lock:
            name = self._group_engine.pop(group_id, None)
            engine = self._engines.get(name) if name is not None else None
            if engine is not None:
                engine.groups.discard(group_id)

    # ---- internals ------------------------------------------------------------------------

    def _get(self, name: str) -> _Engine:
        engine = self._engines.get(name)
        if engine is None:
            raise UnknownEngineError(name)
        return engine

    def _candidates(self) -> list[_Engine]:
        now = self._clock()
        for e in self._engines.values():
            if e.state is EngineState.SUSPECT and now - e.suspect_since >= self._suspect_cooldown_s:
                e.state = EngineState.READY  # cooled down without a verdict: try it again
        ready = [e for e in self._engines.values() if e.state is EngineState.READY]
        if ready:
            return ready
        return [e for e in self._engines.values() if e.state is EngineState.SUSPECT]

    def _unpin_all(self, engine: _Engine) -> None:
        for group_id in engine.groups:
            if self._group_engine.get(group_id) == engine.name:
                del self._group_engine[group_id]
        engine.groups.clear()

    def _set_state(
        self,
        name: str,
        state: EngineState,
        reason: str,
        url: str | None = None,
        *,
        only_from: EngineState | None = None,
    ) -> None:
        with self._lock:
            engine = self._engines.get(name)
            if engine is None and only_from is not None:
                return  # removed meanwhile: nothing to downgrade
            engine = self._get(name)
            if only_from is not None and engine.state is not only_from:
                return
            if engine.state is state and (url is None or url == engine.url):
                return
            if engine.state is EngineState.DEAD and state is not EngineState.DEAD:
                raise ValueError(
                    f"engine {name!r} is dead; register its replacement with add_engine()"
                )
            previous = engine.state
            engine.state = state
            if url is not None:
                engine.url = url
            if state is EngineState.SUSPECT:
                engine.suspect_since = self._clock()
            if state is EngineState.DEAD:
                self._unpin_all(engine)
            event = EngineEvent(name, state, engine.url, reason)
        level = log.info if state is EngineState.READY else log.warning
        level("engine %s: %s -> %s%s", name, previous, state, f" ({reason})" if reason else "")
        self._notify(event)

    def _notify(self, event: EngineEvent) -> None:
        for listener in list(self._listeners):
            listener(event)
