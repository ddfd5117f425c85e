"""Engine membership: one state machine answers "may engine-1 take requests now?".

Every engine of the fleet is in exactly one state, changed only by the methods
below, each of which checks the rule and raises ``IllegalTransition`` otherwise::

    (new) --place(node)--> PLACING --launch--> STARTING      (an elastic fleet's new engine)
    (new) --launch--> STARTING --weights_loaded(v)--> READY <--> SUSPECT
                         |                              |          |
                         +--require_weights(v)--> NEEDS_WEIGHTS(v) <+
                                                        |
   any live state, PLACING --drain--> DRAINING --die--> DEAD --launch--> STARTING (new incarnation)
           any live state, PLACING --die---------------^      remove (DRAINING | DEAD) -> forgotten

    READY | SUSPECT --release--> RELEASED --weights_loaded(v)--> READY
                                    +------require_weights(v)--> NEEDS_WEIGHTS(v)

- PLACING: an elastic fleet created its actor (on ``node`` when it chose one) and waits
  for Ray to place it and for the engine to start: no URL yet, never routed to, no
  weights sent. Dies (a placement that failed or was cancelled) or launches.
- STARTING: launched, weights not known to be current: never routed to.
- NEEDS_WEIGHTS(v): alive but must load version v first (it missed a version, holds
  part of one, or is a replacement): never routed to; the next publish targets it.
- READY: serves current weights. SUSPECT: a request or health check failed; routed
  to only when no engine is READY, READY again after ``suspect_cooldown_s``.
- RELEASED: a co-located engine that gave its device to the learner for a step
  (``rollout_fleet.colocation``): paused, its memory released, never routed to; its
  requests in flight are not cancelled (the pause returned or kept their partials). The
  next publish targets it; only a push that reaches it makes it READY again.
- DRAINING: leaving (scale-down): no new groups, no new versions; requests in flight
  finish or are aborted and resubmitted elsewhere (``rollout_fleet.elastic``).
- DEAD: gone; its requests in flight are regenerated elsewhere. A replacement
  (same name, new process) starts again at STARTING with a new *incarnation*, so
  a late report about the old process (a lease, a weight-sync outcome) is told
  apart and cannot change the new one (``StaleIncarnation``).

Who consults it. The membership lives in the rollout role, beside the router and
the fleet (same process, same event loop): the router routes only to what
``routable()`` lists and keeps just its load counters and group pins; the fleet
launches, suspects and kills; the sample runner listens to ``MembershipEvent``s to
cancel requests on engines that stop serving. The weight sender runs in another
process (learner rank 0), so it does not hold membership at all: before each
publish the rollout role hands it ``weight_targets()`` (a typed ``WeightTargets``,
travelling with the publish call), and the sender's report comes back as a
``SyncOutcome`` that ``apply_sync`` turns into transitions. Why here and not on the
learner: every transition except "weights loaded" is observed on the rollout side
(launches, health checks, failed requests), and routing consults it per request,
so the state lives where it is read most and changes most; weight sync needs it
only once per version and gets it as data.

Each member also records the Ray node it runs on (``node``: where an elastic fleet
placed it, or what its actor reported at launch), so a node that leaves the cluster
names the engines it takes with it (``on_node``).

Thread-safe (one lock); listeners are called outside the lock, on the thread that
made the change. Left out: persisting membership across a restart of the rollout
role (the run stops then).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from fleetrl.log import get_logger

log = get_logger(__name__)


class EngineStatus(enum.StrEnum):
    PLACING = "placing"
    STARTING = "starting"
    NEEDS_WEIGHTS = "needs_weights"
    READY = "ready"
    SUSPECT = "suspect"
    RELEASED = "released"
    DRAINING = "draining"
    DEAD = "dead"


S = EngineStatus
LIVE = frozenset({S.STARTING, S.NEEDS_WEIGHTS, S.READY, S.SUSPECT, S.RELEASED})
SERVING = frozenset({S.READY, S.SUSPECT})

# action -> the states it may start from (``None``: the engine is not known yet)
RULES: dict[str, frozenset[EngineStatus | None]] = {
    "place": frozenset({None, S.DEAD}),
    "launch": frozenset({None, S.DEAD, S.PLACING}),
    "weights_loaded": frozenset({S.STARTING, S.NEEDS_WEIGHTS, S.READY, S.SUSPECT, S.RELEASED}),
    "require_weights": frozenset(LIVE),
    "suspect": frozenset(SERVING),
    "release": frozenset(SERVING),
    "clear_suspect": frozenset({S.SUSPECT}),
    "drain": frozenset({*LIVE, S.PLACING}),
    "die": frozenset({*LIVE, S.DRAINING, S.PLACING}),
    "remove": frozenset({S.DRAINING, S.DEAD}),
}


class MembershipError(ValueError):
    """A membership call that cannot apply."""


class UnknownEngineError(MembershipError, KeyError):
    """An engine name the membership does not know."""

    def __str__(self) -> str:
        return f"unknown engine {self.args[0]!r}"


class IllegalTransition(MembershipError):
    """The action is not allowed from the engine's current state (see ``RULES``)."""


class StaleIncarnation(MembershipError):
    """The call names an earlier process of the engine (it was replaced meanwhile)."""


class MembershipEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One change of one engine, as told to listeners (``removed``: forgotten for good)."""

    name: str
    status: EngineStatus
    url: str
    incarnation: int
    reason: str = ""
    removed: bool = False
    joined_s: float | None = None  # a placed engine's first READY: seconds since its place()


class EngineTarget(msgspec.Struct, frozen=True, kw_only=True):
    """One engine a publish must reach: which process (``incarnation``) at which URL.

    ``device_rank``: the learner rank whose device a co-located engine shares (that rank
    pushes to it by handle); -1 for an engine on its own devices (broadcast to).
    """

    name: str
    url: str
    incarnation: int
    device_rank: int = -1


class WeightTargets(msgspec.Struct, frozen=True, kw_only=True):
    """The engines the next publish goes to (every live engine that answers)."""

    engines: tuple[EngineTarget, ...] = ()


class SyncOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one publish of ``version`` did to its targets.

    ``failed``: engine -> why it was dropped (it missed the version). ``partial``:
    engines that hold only part of it (a broadcast failed mid-stream). Every other
    target holds ``version``.
    """

    version: int
    targets: tuple[EngineTarget, ...] = ()
    failed: dict[str, str] = {}
    partial: tuple[str, ...] = ()


@dataclass
class _Member:
    name: str
    url: str
    status: EngineStatus
    incarnation: int
    node: str = ""  # the Ray node it runs on ("" = not known)
    version: int | None = None  # the weights it holds, once known
    needs_version: int | None = None  # NEEDS_WEIGHTS: what it must load before serving
    suspect_since: float = 0.0
    placed_at: float | None = None  # place() time, until it first serves (join time)
    reason: str = ""


Listener = Callable[[MembershipEvent], None]


class Membership:
    """The engines of one fleet and their states; see the module docstring."""

    def __init__(
        self, *, suspect_cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if suspect_cooldown_s < 0:
            raise ValueError(f"suspect_cooldown_s must be >= 0, got {suspect_cooldown_s}")
        self._suspect_cooldown_s = suspect_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._incarnations = 0
        self._listeners: list[Listener] = []
        self.latest_version = 0  # the newest version any publish delivered
        # the engines a publish on its way goes to (begin_sync .. apply_sync): an engine
        # leaving the fleet is stopped only once no broadcast waits for it
        self._syncing: frozenset[str] = frozenset()

    # ---- transitions --------------------------------------------------------------------

    def place(self, name: str, node: str = "") -> int:
        """An elastic fleet created ``name``'s actor (on ``node``, if it chose one) and waits
        for it to start; its incarnation."""
        with self._lock:
            old = self._members.get(name)
            self._check("place", name, old.status if old else None)
            self._incarnations += 1
            member = _Member(name, "", S.PLACING, self._incarnations, node=node)
            member.placed_at = self._clock()
            self._members[name] = member
            event = self._event(member, f"placing on node {node[:12]}" if node else "placing")
        self._emit(event)
        return member.incarnation

    def launch(self, name: str, url: str, *, node: str = "") -> int:
        """A new process serves ``name`` at ``url`` on ``node`` (first start, a replacement,
        or a placed engine that started); its incarnation."""
        with self._lock:
            old = self._members.get(name)
            self._check("launch", name, old.status if old else None)
            if old is not None and old.status is S.PLACING:  # the placed process, now serving
                member = old
                member.url, member.node = url, node or old.node
                event = self._move(member, S.STARTING, "launched")
            else:
                self._incarnations += 1
                member = _Member(name, url, S.STARTING, self._incarnations, node=node)
                self._members[name] = member
                event = self._event(member, "launched")
        self._emit(event)
        return member.incarnation

    def weights_loaded(self, name: str, version: int, *, incarnation: int | None = None) -> None:
        """``name`` holds ``version`` (at least the one it needed): it serves."""
        with self._lock:
            member = self._member(name, incarnation)
            self._check("weights_loaded", name, member.status)
            if member.needs_version is not None and version < member.needs_version:
                raise IllegalTransition(
                    f"engine {name!r} needs version {member.needs_version}, "
                    f"loading {version} does not make it ready"
                )
            member.version, member.needs_version = version, None
            event = self._move(member, S.READY, f"holds version {version}")
            if event is not None and member.placed_at is not None:  # a placed engine joined
                joined = self._clock() - member.placed_at
                member.placed_at = None
                event = msgspec.structs.replace(event, joined_s=joined)
        self._emit(event)

    def require_weights(
        self, name: str, version: int, reason: str, *, incarnation: int | None = None
    ) -> None:
        """``name`` must load ``version`` before it serves again (no requests until then)."""
        with self._lock:
            member = self._member(name, incarnation)
            self._check("require_weights", name, member.status)
            member.needs_version = max(version, member.needs_version or 0)
            event = self._move(member, S.NEEDS_WEIGHTS, reason)
        self._emit(event)

    def suspect(self, name: str, reason: str, *, incarnation: int | None = None) -> None:
        """A request or health check of a serving engine failed: route elsewhere for a while."""
        with self._lock:
            member = self._member(name, incarnation)
            self._check("suspect", name, member.status)
            member.suspect_since = self._clock()
            event = self._move(member, S.SUSPECT, reason)
        self._emit(event)

    def clear_suspect(self, name: str, reason: str = "healthy again") -> None:
        """A suspect engine answered again: it serves as before."""
        with self._lock:
            member = self._member(name, None)
            self._check("clear_suspect", name, member.status)
            event = self._move(member, S.READY, reason)
        self._emit(event)

    def release(self, name: str, reason: str, *, incarnation: int | None = None) -> None:
        """A co-located engine gives its device to the learner: no new requests until a
        publish reaches it (``weights_loaded``)."""
        with self._lock:
            member = self._member(name, incarnation)
            self._check("release", name, member.status)
            event = self._move(member, S.RELEASED, reason)
        self._emit(event)

    def drain(self, name: str, reason: str = "leaving") -> None:
        """No new groups (and no new version) for ``name``; its requests in flight finish or
        are aborted and resubmitted elsewhere. A placement no longer wanted drains too."""
        with self._lock:
            member = self._member(name, None)
            self._check("drain", name, member.status)
            event = self._move(member, S.DRAINING, reason)
        self._emit(event)

    def die(self, name: str, reason: str, *, incarnation: int | None = None) -> None:
        """The engine's process is gone (or will be killed): never route to it again."""
        with self._lock:
            member = self._member(name, incarnation)
            self._check("die", name, member.status)
            member.version = member.needs_version = None
            event = self._move(member, S.DEAD, reason)
        self._emit(event)

    def remove(self, name: str) -> None:
        """Forget a drained or dead engine (scale-down)."""
        with self._lock:
            member = self._member(name, None)
            self._check("remove", name, member.status)
            del self._members[name]
            event = msgspec.structs.replace(self._event(member, "removed"), removed=True)
        self._emit(event)

    def begin_sync(self, targets: WeightTargets) -> WeightTargets:
        """A publish to ``targets`` starts (its outcome comes back through ``apply_sync``)."""
        with self._lock:
            self._syncing = frozenset(t.name for t in targets.engines)
        return targets

    def syncing(self, name: str) -> bool:
        """Whether a publish on its way counts on ``name`` (its weight group includes it)."""
        with self._lock:
            return name in self._syncing

    def apply_sync(self, outcome: SyncOutcome) -> None:
        """Turn one publish's outcome into transitions (targets replaced meanwhile are skipped)."""
        with self._lock:
            self._syncing = frozenset()
        for target in outcome.targets:
            try:
                if target.name in outcome.failed:
                    reason = f"missed version {outcome.version}: {outcome.failed[target.name]}"
                    self.require_weights(
                        target.name, outcome.version, reason, incarnation=target.incarnation
                    )
                elif target.name in outcome.partial:
                    reason = f"holds part of version {outcome.version}"
                    self.require_weights(
                        target.name, outcome.version, reason, incarnation=target.incarnation
                    )
                else:
                    self.weights_loaded(
                        target.name, outcome.version, incarnation=target.incarnation
                    )
            except (StaleIncarnation, IllegalTransition, UnknownEngineError) as err:
                # it died, drained or was replaced while the version was on its way
                log.info("weight sync outcome for %s not applied: %s", target.name, err)
        if not outcome.partial:
            with self._lock:
                self.latest_version = max(self.latest_version, outcome.version)

    # ---- queries ------------------------------------------------------------------------

    def status(self, name: str) -> EngineStatus:
        with self._lock:
            return self._member(name, None).status

    def url(self, name: str) -> str:
        with self._lock:
            return self._member(name, None).url

    def incarnation(self, name: str) -> int:
        with self._lock:
            return self._member(name, None).incarnation

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._members)

    def urls(self) -> dict[str, str]:
        """URL of every engine whose process is running (not dead, not still placing)."""
        with self._lock:
            return {
                m.name: m.url for m in self._members.values() if m.status not in (S.DEAD, S.PLACING)
            }

    def node(self, name: str) -> str:
        with self._lock:
            return self._member(name, None).node

    def on_node(self, node: str) -> list[str]:
        """Engines (placing or running, not dead) on Ray node ``node``."""
        with self._lock:
            return sorted(
                m.name for m in self._members.values() if m.node == node and m.status is not S.DEAD
            )

    def count(self, statuses: frozenset[EngineStatus] | set[EngineStatus]) -> int:
        """How many engines are in one of ``statuses``."""
        with self._lock:
            return sum(m.status in statuses for m in self._members.values())

    def in_state(self, statuses: frozenset[EngineStatus] | set[EngineStatus]) -> list[str]:
        """Names of the engines in one of ``statuses``, sorted."""
        with self._lock:
            return sorted(m.name for m in self._members.values() if m.status in statuses)

    def routable(self) -> list[tuple[str, int, EngineStatus]]:
        """(name, incarnation, status) of the engines a new request may go to: READY ones,
        else SUSPECT ones. Suspects whose cooldown passed become READY first."""
        now = self._clock()
        with self._lock:
            cooled = [
                m
                for m in self._members.values()
                if m.status is S.SUSPECT and now - m.suspect_since >= self._suspect_cooldown_s
            ]
            events = [self._move(m, S.READY, "suspect cooldown passed") for m in cooled]
            ready = [m for m in self._members.values() if m.status is S.READY]
            pool = ready or [m for m in self._members.values() if m.status is S.SUSPECT]
            out = [(m.name, m.incarnation, m.status) for m in sorted(pool, key=lambda m: m.name)]
        for event in events:
            self._emit(event)
        return out

    def behind(self) -> list[str]:
        """Live engines that must receive weights before serving (STARTING, NEEDS_WEIGHTS)."""
        with self._lock:
            return sorted(
                m.name for m in self._members.values() if m.status in (S.STARTING, S.NEEDS_WEIGHTS)
            )

    def weight_targets(self, exclude: set[str] | frozenset[str] = frozenset()) -> WeightTargets:
        """Every live engine (but ``exclude``): the next publish sends each the full weights."""
        with self._lock:
            engines = tuple(
                EngineTarget(name=m.name, url=m.url, incarnation=m.incarnation)
                for m in sorted(self._members.values(), key=lambda m: m.name)
                if m.status in LIVE and m.name not in exclude
            )
        return WeightTargets(engines=engines)

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {
                m.name: {
                    "state": str(m.status),
                    "url": m.url,
                    "incarnation": m.incarnation,
                    "node": m.node,
                    "version": m.version,
                    "needs_version": m.needs_version,
                    "reason": m.reason,
                }
                for m in self._members.values()
            }

    # ---- listeners ----------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    # ---- internals ----------------------------------------------------------------------

    def _member(self, name: str, incarnation: int | None) -> _Member:
        member = self._members.get(name)
        if member is None:
            raise UnknownEngineError(name)
        if incarnation is not None and incarnation != member.incarnation:
            raise StaleIncarnation(
                f"engine {name!r}: incarnation {incarnation} was replaced by {member.incarnation}"
            )
        return member

    @staticmethod
    def _check(action: str, name: str, status: EngineStatus | None) -> None:
        if status not in RULES[action]:
            allowed = sorted(str(s) if s else "(new)" for s in RULES[action])
            raise IllegalTransition(
                f"engine {name!r}: cannot {action} from {status or '(new)'}; "
                f"allowed from {', '.join(allowed)}"
            )

    def _move(self, member: _Member, status: EngineStatus, reason: str) -> MembershipEvent | None:
        """Set the state (caller holds the lock); the event to emit, None when unchanged."""
        if member.status is status:
            return None
        previous, member.status, member.reason = member.status, status, reason
        (log.info if status in (S.READY, S.STARTING, S.RELEASED, S.DRAINING) else log.warning)(
            "engine %s: %s -> %s%s", member.name, previous, status, f" ({reason})" if reason else ""
        )
        return self._event(member, reason)

    @staticmethod
    def _event(member: _Member, reason: str) -> MembershipEvent:
        return MembershipEvent(
            name=member.name,
            status=member.status,
            url=member.url,
            incarnation=member.incarnation,
            reason=reason,
        )

    def _emit(self, event: MembershipEvent | None) -> None:
        if event is None:
            return
        for listener in list(self._listeners):
            listener(event)
