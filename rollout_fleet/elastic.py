"""Elastic fleets: the number of engines follows the cluster and the user, within a range.

One ``ElasticFleet`` drives one ``EngineFleet`` (the rollout engines, or the reward
servers) between ``min_engines`` and ``max_engines``, from ``num_engines`` at the start.
It owns one number, the **target**, and makes the fleet match it; every engine's state
stays the membership's (rollout_fleet/membership.py)::

    every check_interval_s (``run``), or at once after ``set_target``:
      nodes = the cluster's nodes and their free resources         (rollout_fleet/cluster.py)
      an engine's node is gone  -> the engine is lost: DEAD at once (its requests in flight
                                   are regenerated elsewhere), forgotten; the target drops
                                   by one, never below min_engines (no replacement waits
                                   for a node that will not come back)
      a node of the fleet's kind joined (``rollout`` / ``reward`` marker)
                                -> the target grows by the engines that fit there (up to
                                   max_engines), and they are placed on that node; one
                                   seen without room (its free resources not in the
                                   cluster's view yet) is looked at again each round for
                                   ARRIVAL_GRACE_S before it counts as joined with none
      fewer engines than target -> place one per free bundle, on the node with most room
                                   (PLACING, then STARTING: it loads the current version
                                   before it serves, as a replacement does); with
                                   ray.autoscaling the autoscaler is asked for the target's
                                   bundles (``request_resources``), so it adds nodes
      more engines than target  -> cancel placements, stop engines not serving yet, then
                                   drain the newest serving ones (below)
      fewer than min_engines running for longer than the wait bound
                                -> ``failure`` says what is missing; the run stops on it

    set_target(n)  (``fleetrl fleet scale``): refused outside [min_engines, max_engines]

Draining one engine (scale-down): DRAINING in the membership, so no new request and no
new version reaches it; its requests in flight finish there (``weight_sync.pause_mode``
in_place, up to ``drain_timeout_s``) or are aborted at once (abort, retract), and then
also after the deadline: ``/pause_generation`` with mode abort returns every partial,
which the sample runner resubmits elsewhere with its tokens so far. Then, once no publish
on its way counts on it (``Membership.syncing``: a member of a weight group killed
mid-broadcast would stall the others' broadcast until its timeout), the engine is
stopped, its actor killed (its bundle released) and it is forgotten. The next publish's
weight group leaves it out.

An engine that dies on a node still in the cluster (a crash) is replaced in place by the
fleet, as in a fixed fleet; the fleet asks ``engine_died`` first, which says whether the
node is gone.

Figures (``metrics``): the target and its bounds, engines that joined (placed, then
serving), left (drained) and were lost (with their node), the seconds from placement to
serving of the last join and the longest, the last drain's seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.cluster import ClusterView, NodeView, engines_that_fit, missing_for
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import (
    LIVE,
    SERVING,
    EngineStatus,
    MembershipError,
    MembershipEvent,
)

log = get_logger(__name__)

S = EngineStatus
DRAIN_POLL_S = 0.2
ABORT_GRACE_S = 10.0  # after an abort, partials this long to come back before the stop
SYNC_WAIT_S = 600.0  # a leaving engine a publish still counts on waits this long for it
PROGRESS_S = 10.0  # below the minimum: a line saying what is missing, this often
ARRIVAL_GRACE_S = 30.0  # a node that joined without room is looked at again this long
NOT_SERVING_YET = frozenset({S.PLACING, S.STARTING, S.NEEDS_WEIGHTS})


class ScaleRefused(ValueError):
    """A target outside the fleet's range (or a fleet that cannot scale): one line."""


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """What one elastic fleet needs to know; see the module docstring."""

    fleet: str  # "rollout" | "reward": names its messages and its autoscaler request
    key: str  # its config section, for messages: "rollout" | "reward.model"
    start: int
    min_engines: int
    max_engines: int
    bundle: dict[str, float]  # one engine's Ray resources, its node marker included
    marker: str  # the resource that marks the fleet's kind of node
    check_interval_s: float = 2.0
    wait_bound_s: float = 600.0  # below min_engines this long: the run stops
    drain_timeout_s: float = 60.0
    abort_on_drain: bool = False  # weight_sync.pause_mode abort | retract: at once
    follow_nodes: bool = True  # arrivals grow the target, losses shrink it
    ask_autoscaler: bool = False  # ray.autoscaling: request the target's bundles
    metrics_prefix: str = "fleet"


def engine_bundle(cpus: float, gpus: float, marker: str, marker_share: float) -> dict[str, float]:
    """One engine's resources as Ray counts them (``rollout_fleet.actors`` asks for these)."""
    return {"CPU": cpus, "GPU": gpus, marker: marker_share}


class ElasticFleet:
    """Keeps an ``EngineFleet`` at its target; see the module docstring."""

    def __init__(
        self,
        fleet: EngineFleet,
        settings: ElasticSettings,
        cluster: ClusterView,
        *,
        in_flight: Callable[[str], int],
        abort: Callable[[str], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not settings.min_engines <= settings.start <= settings.max_engines:
            raise ValueError(
                f"{settings.key}: start {settings.start} outside "
                f"[{settings.min_engines}, {settings.max_engines}]"
            )
        self.fleet = fleet
        self.membership = fleet.membership
        self.settings = settings
        self.cluster = cluster
        self.target = settings.start
        self._in_flight = in_flight
        self._abort = abort
        self._clock = clock
        self._known_nodes: set[str] | None = None
        self._arrivals: dict[str, int] = {}  # node that joined -> engines still to place there
        self._newcomers: dict[str, float] = {}  # node that joined without room -> first seen
        self._drains: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self._below_since: float | None = None
        self._last_line = 0.0
        self.failure = ""  # set when the fleet stayed below min_engines too long
        self.joins = self.leaves = self.lost = self.placed = 0
        self.join_s = self.join_s_max = self.drain_s = 0.0

    # ---- lifecycle ---------------------------------------------------------------------

    def attach(self) -> None:
        """Take over the fleet's death handling and listen for joins (after its start)."""
        self.fleet.on_engine_death = self.engine_died
        self.membership.subscribe(self._on_event)

    async def run(self) -> None:
        """Reconcile every ``check_interval_s`` (or when woken) until ``stop``."""
        while not self._stopping:
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - a service loop: a GCS hiccup must not end it
                log.exception("%s fleet: reconcile failed; next round", self.settings.fleet)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.check_interval_s)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        with contextlib.suppress(ValueError):
            self.membership.unsubscribe(self._on_event)

    # ---- the target --------------------------------------------------------------------

    def set_target(self, engines: int) -> tuple[int, int]:
        """``fleetrl fleet scale``: aim at ``engines``; (previous target, new target)."""
        low, high = self.settings.min_engines, self.settings.max_engines
        if not low <= engines <= high:
            raise ScaleRefused(
                f"{self.settings.fleet} fleet: {engines} engines is outside "
                f"{self.settings.key}.min_engines..max_engines = {low}..{high}"
            )
        previous, self.target = self.target, engines
        self._arrivals.clear()  # the user's number replaces what arrivals asked for
        log.info("%s fleet: target %d -> %d engines", self.settings.fleet, previous, engines)
        self._wake.set()
        return previous, engines

    def counted(self) -> int:
        """Engines that count toward the target: placing or live (not draining, not dead)."""
        return len(self.fleet.engine_names(LIVE | {S.PLACING}))

    # ---- one round -----------------------------------------------------------------------

    async def reconcile(self) -> None:
        nodes = await asyncio.to_thread(self.cluster.nodes)
        alive = {n.node_id: n for n in nodes if n.alive}
        self._lose_engines_of_gone_nodes(alive)
        if self.settings.follow_nodes:
            self._note_arrivals(alive)
        running = self.counted()
        if running < self.target:
            self._grow(alive, self.target - running)
        elif running > self.target:
            self._shrink(running - self.target)
        self._check_minimum(alive)
        if self.settings.ask_autoscaler:
            bundles = [dict(self.settings.bundle) for _ in range(self.target)]
            await asyncio.to_thread(self.cluster.request, self.settings.fleet, bundles)

    def _lose_engines_of_gone_nodes(self, alive: dict[str, NodeView]) -> None:
        for name in self.fleet.engine_names():
            node = self.membership.node(name)
            if node and node not in alive:
                self._lose(name, node)
        for node in [n for n in self._arrivals if n not in alive]:
            del self._arrivals[node]
        for node in [n for n in self._newcomers if n not in alive]:
            del self._newcomers[node]

    def _lose(self, name: str, node: str) -> None:
        status = self._status(name)
        if status is None:  # lost already: a round and a death report both saw its node go
            return
        counted = status in LIVE | {S.PLACING}  # not one already leaving
        self.fleet.lose_engine(name, f"its node {node[:12]} left the cluster")
        self.lost += 1
        if counted:
            self.target = max(self.settings.min_engines, self.target - 1)
        log.warning(
            "%s fleet: %s lost with node %s; target now %d",
            self.settings.fleet, name, node[:12], self.target,
        )  # fmt: skip

    def _note_arrivals(self, alive: dict[str, NodeView]) -> None:
        if self._known_nodes is None:  # the first round: the nodes the run started on
            self._known_nodes = set(alive)
            return
        for node_id, node in alive.items():
            if node_id in self._known_nodes:
                continue
            fit = engines_that_fit(node.free, self.settings.bundle)
            if fit == 0 and node.has(self.settings.marker) and self._still_arriving(node_id):
                continue  # its room may not be in the cluster's view yet: judged next round
            self._known_nodes.add(node_id)
            self._newcomers.pop(node_id, None)
            if not node.has(self.settings.marker):
                continue
            grow = min(fit, self.settings.max_engines - self.target)
            log.info(
                "%s fleet: %s joined with room for %d engines; placing %d there%s",
                self.settings.fleet, node.label, fit, max(grow, 0),
                f" ({missing_for(node, self.settings.bundle)})" if fit == 0 else "",
            )  # fmt: skip
            if grow > 0:
                self.target += grow
                self._arrivals[node_id] = grow

    def _still_arriving(self, node_id: str) -> bool:
        """Whether a node that joined without room is within ``ARRIVAL_GRACE_S`` of when it
        was first seen: a raylet that joined a moment ago may be listed before its free
        resources reach the cluster's view, or with them not yet released."""
        now = self._clock()
        return now - self._newcomers.setdefault(node_id, now) < ARRIVAL_GRACE_S

    def _grow(self, alive: dict[str, NodeView], deficit: int) -> None:
        placing = Counter(self.membership.node(n) for n in self.fleet.engine_names({S.PLACING}))
        room = {
            node_id: engines_that_fit(node.free, self.settings.bundle) - placing[node_id]
            for node_id, node in alive.items()
            if node.has(self.settings.marker)
        }
        while deficit > 0:
            reserved = [n for n, k in self._arrivals.items() if k > 0 and room.get(n, 0) > 0]
            node_id = reserved[0] if reserved else max(room, key=room.__getitem__, default=None)
            if node_id is None or room[node_id] <= 0:
                return  # no room: the autoscaler has the request, the minimum check waits
            if reserved:
                self._arrivals[node_id] -= 1
            room[node_id] -= 1
            deficit -= 1
            name = self.fleet.place_engine(node_id)
            self.placed += 1
            log.info(
                "%s fleet: placing %s on %s (target %d)",
                self.settings.fleet, name, alive[node_id].label, self.target,
            )  # fmt: skip

    def _shrink(self, excess: int) -> None:
        """Placements first, then engines not serving yet, then the newest serving ones."""

        def order(name: str) -> tuple[int, int]:
            rank = {S.PLACING: 0, S.STARTING: 1, S.NEEDS_WEIGHTS: 1}.get(self._status(name), 2)
            return rank, -int(name.rsplit("-", 1)[-1])

        for name in sorted(self.fleet.engine_names(LIVE | {S.PLACING}), key=order)[:excess]:
            serving = self._status(name) not in NOT_SERVING_YET
            self.membership.drain(name, "scale-down")  # now: the next round counts it gone
            if serving:
                self._spawn(self._drain(name))
            else:
                self._spawn(self._stop(name, "not needed (scale-down)"))
                self.leaves += 1

    def _check_minimum(self, alive: dict[str, NodeView]) -> None:
        running = len(self.fleet.engine_names(LIVE))
        if running >= self.settings.min_engines:
            self._below_since = None
            return
        now = self._clock()
        if self._below_since is None:
            self._below_since = self._last_line = now
        waited = now - self._below_since
        what = (
            f"{self.settings.fleet} fleet: {running} of at least {self.settings.min_engines} "
            f"engines ({self.settings.key}.min_engines) running for {waited:.0f}s: "
            f"{self.missing(alive)}"
        )
        if waited >= self.settings.wait_bound_s:
            self.failure = f"{what} (waited ray.placement_timeout_s = {self.settings.wait_bound_s:.0f}s)"  # fmt: skip
        elif now - self._last_line >= PROGRESS_S:
            self._last_line = now
            log.warning("%s; waiting up to %.0fs", what, self.settings.wait_bound_s)

    def missing(self, alive: dict[str, NodeView]) -> str:
        """What the cluster lacks for one more engine, per node of the fleet's kind."""
        nodes = [n for n in alive.values() if n.has(self.settings.marker)]
        if not nodes:
            return f"no node in the cluster declares the '{self.settings.marker}' resource"
        lines = [missing_for(n, self.settings.bundle) for n in nodes]
        return "; ".join(line for line in lines if line) or "room is free but not yet granted"

    # ---- engines leaving ------------------------------------------------------------------

    async def engine_died(self, name: str, reason: str) -> bool:
        """The fleet found ``name`` dead: lost for good when its node is gone (True), else
        the fleet replaces it in place (False)."""
        node = self.membership.node(name)
        if not node:
            return False
        nodes = await asyncio.to_thread(self.cluster.nodes)
        if any(n.node_id == node and n.alive for n in nodes):
            return False
        self._lose(name, node)
        return True

    async def _drain(self, name: str) -> None:
        """``name`` is DRAINING: let its requests finish (or abort them), then stop it."""
        started = self._clock()
        if self.settings.abort_on_drain:
            await self._abort_quietly(name)
        deadline = started + self.settings.drain_timeout_s
        while self._in_flight(name) and self._clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._in_flight(name):
            log.info("%s: %d requests still in flight after %.0fs; aborting them", name, self._in_flight(name), self.settings.drain_timeout_s)  # fmt: skip
            await self._abort_quietly(name)
            grace = self._clock() + ABORT_GRACE_S
            while self._in_flight(name) and self._clock() < grace:
                await asyncio.sleep(DRAIN_POLL_S)
        await self._stop(name, "drained (scale-down)")
        self.leaves += 1
        self.drain_s = self._clock() - started
        log.info("%s fleet: %s drained and stopped in %.1fs", self.settings.fleet, name, self.drain_s)  # fmt: skip

    async def _stop(self, name: str, reason: str) -> None:
        """Stop a leaving engine once no publish on its way counts on it: killing a member
        of a weight group mid-broadcast would stall the broadcast to the others until its
        timeout."""
        deadline = self._clock() + SYNC_WAIT_S
        while self.membership.syncing(name) and self._clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.fleet.remove_engine(name, reason)

    async def _abort_quietly(self, name: str) -> None:
        if self._abort is None:
            return
        try:
            await self._abort(name)
        except Exception as err:  # noqa: BLE001 - an engine leaving may not answer: it stops anyway
            log.info("%s: abort before leaving failed: %r", name, err)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    # ---- figures ---------------------------------------------------------------------------

    def _on_event(self, event: MembershipEvent) -> None:
        if event.joined_s is not None:
            self.joins += 1
            self.join_s = event.joined_s
            self.join_s_max = max(self.join_s_max, event.joined_s)
            log.info("%s joined: serving %.1fs after it was placed", event.name, event.joined_s)

    def _status(self, name: str) -> EngineStatus | None:
        try:
            return self.membership.status(name)
        except MembershipError:
            return None

    def metrics(self) -> dict[str, float]:
        p = self.settings.metrics_prefix
        return {
            f"{p}/engines_target": float(self.target),
            f"{p}/engines_min": float(self.settings.min_engines),
            f"{p}/engines_max": float(self.settings.max_engines),
            f"{p}/joins": float(self.joins),
            f"{p}/leaves": float(self.leaves),
            f"{p}/engines_lost_with_node": float(self.lost),
            f"{p}/join_s": self.join_s,
            f"{p}/join_s_max": self.join_s_max,
            f"{p}/drain_s": self.drain_s,
        }

    def serving(self) -> int:
        return self.membership.count(SERVING)
