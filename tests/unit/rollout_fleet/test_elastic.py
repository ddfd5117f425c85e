"""The elastic controller with fake actors and a fake cluster: targets within the range,
nodes that join and leave, placement where there is room, the minimum's bounded wait,
draining per pause mode, and the figures it reports."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from rollout_fleet.cluster import NodeView
from rollout_fleet.config import RolloutConfig
from rollout_fleet.elastic import ARRIVAL_GRACE_S, ElasticFleet, ElasticSettings, ScaleRefused
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import EngineStatus, Membership, SyncOutcome
from tests.unit.rollout_fleet.fakes import FakeActor

S = EngineStatus
BUNDLE = {"CPU": 1.0, "GPU": 0.0, "rollout": 0.001}


@dataclass
class FakeCluster:
    """Nodes by id -> free CPUs (each declares 'rollout'); the autoscaler's requests."""

    free: dict[str, float] = field(default_factory=lambda: {"head": 1.0})
    dead: set[str] = field(default_factory=set)
    unreported: set[str] = field(default_factory=set)  # listed, free resources not yet in view
    requests: list[int] = field(default_factory=list)

    def nodes(self) -> list[NodeView]:
        return [
            NodeView(
                node_id=n,
                alive=n not in self.dead,
                total={"CPU": 8.0, "rollout": 1.0},
                free={} if n in self.unreported else {"CPU": cpus, "rollout": 1.0},
            )
            for n, cpus in self.free.items()
        ]

    def request(self, fleet: str, bundles: list[dict[str, float]]) -> None:
        self.requests.append(len(bundles))


class Harness:
    def __init__(self, *, start=1, low=1, high=3, pause_abort=False, drain_s=5.0, wait_s=60.0):
        self.members = Membership()
        self.cluster = FakeCluster()
        self.actors: list[FakeActor] = []
        self.in_flight: dict[str, int] = {}
        self.aborted: list[str] = []
        self.now = 0.0
        config = RolloutConfig(num_engines=start, elastic=True, min_engines=low, max_engines=high)
        self.fleet = EngineFleet(
            config,
            "/model",
            membership=self.members,
            actor_factory=lambda spec: self._actor(spec, "head"),
            health_probe=self._healthy,
            weights_pushed=True,
        )
        self.fleet._node_actor_factory = self._actor
        settings = ElasticSettings(
            fleet="rollout",
            key="rollout",
            start=start,
            min_engines=low,
            max_engines=high,
            bundle=dict(BUNDLE),
            marker="rollout",
            wait_bound_s=wait_s,
            drain_timeout_s=drain_s,
            abort_on_drain=pause_abort,
            ask_autoscaler=True,
        )
        self.elastic = ElasticFleet(
            self.fleet,
            settings,
            self.cluster,
            in_flight=lambda name: self.in_flight.get(name, 0),
            abort=self._abort,
            clock=lambda: self.now,
        )

    def _actor(self, spec, node):
        actor = FakeActor(spec, node=node)
        self.actors.append(actor)
        return actor

    async def _healthy(self, url):
        return True

    async def _abort(self, name):
        self.aborted.append(name)
        self.in_flight[name] = 0  # partials come back at once, as after an abort pause

    async def start(self):
        await self.fleet.start()
        self.publish(0)
        self.elastic.attach()
        await self.settle()  # the first round notes the nodes the run started on

    def publish(self, version):
        self.members.apply_sync(SyncOutcome(version=version, targets=self.members.weight_targets().engines))  # fmt: skip

    async def settle(self):
        await self.elastic.reconcile()
        for _ in range(5):  # placements and drains run as tasks
            await asyncio.sleep(0)
            await self.fleet.wait_replacements()
            await asyncio.sleep(0.01)

    def state(self):
        return {n: str(row["state"]) for n, row in sorted(self.members.snapshot().items())}

    def node_of(self, name):
        return self.members.node(name)


def run(coro):
    return asyncio.run(coro)


def test_scale_up_places_engines_where_there_is_room_and_they_serve_only_once_they_hold_the_version():
    h = Harness()

    async def scenario():
        await h.start()
        h.cluster.free.update(head=0.0, n1=2.0)  # engine-0 took the head's CPU
        assert h.elastic.set_target(3) == (1, 3)
        await h.settle()
        assert h.state() == {"engine-0": "ready", "engine-1": "needs_weights", "engine-2": "needs_weights"}  # fmt: skip
        assert {h.node_of("engine-1"), h.node_of("engine-2")} == {"n1"}
        assert h.members.routable() == [("engine-0", 1, S.READY)]  # joiners wait for weights
        h.publish(4)  # the driver's rejoin sends them the current version
        assert [n for n, _, _ in h.members.routable()] == ["engine-0", "engine-1", "engine-2"]
        metrics = h.elastic.metrics()
        assert metrics["fleet/joins"] == 2 and metrics["fleet/engines_target"] == 3
        assert h.cluster.requests[-1] == 3  # the autoscaler hears the target

    run(scenario())


def test_a_target_outside_the_range_is_refused_in_one_line_naming_the_keys():
    h = Harness(low=1, high=3)
    with pytest.raises(ScaleRefused) as err:
        h.elastic.set_target(4)
    assert str(err.value) == (
        "rollout fleet: 4 engines is outside rollout.min_engines..max_engines = 1..3"
    )
    with pytest.raises(ScaleRefused):
        h.elastic.set_target(0)
    assert h.elastic.target == 1


def test_a_node_that_joins_gets_the_engines_that_fit_on_it_up_to_the_maximum():
    h = Harness(high=3)

    async def scenario():
        await h.start()
        h.cluster.free.update(head=4.0, big=5.0)  # the head has room too: not where they go
        await h.settle()
        assert h.elastic.target == 3  # 1 + min(5 fit, 2 left to the maximum)
        placed = [n for n in h.members.names() if n != "engine-0"]
        assert [h.node_of(n) for n in placed] == ["big", "big"]

    run(scenario())


def test_a_node_listed_before_its_free_resources_are_reported_gets_its_engines_once_they_are():
    h = Harness(high=3)

    async def scenario():
        await h.start()
        h.cluster.free["late"] = 2.0
        h.cluster.unreported.add("late")  # Ray lists the raylet; the GCS has no free view yet
        await h.settle()
        assert h.elastic.target == 1 and h.members.names() == ["engine-0"]
        h.cluster.unreported.clear()
        await h.settle()
        assert h.elastic.target == 3
        placed = [n for n in h.members.names() if n != "engine-0"]
        assert [h.node_of(n) for n in placed] == ["late", "late"]

    run(scenario())


def test_a_node_that_joins_without_room_is_looked_at_again_for_the_grace_and_then_counted():
    h = Harness(high=3)

    async def scenario():
        await h.start()
        h.cluster.free.update(busy=0.0, full=0.0)  # their CPUs not released yet
        await h.settle()
        h.now += ARRIVAL_GRACE_S / 2
        h.cluster.free["busy"] = 1.0  # released within the grace: it gets its engine
        await h.settle()
        assert h.elastic.target == 2
        assert [h.node_of(n) for n in h.members.names() if n != "engine-0"] == ["busy"]
        h.now += ARRIVAL_GRACE_S  # "full" stayed without room past the grace: joined with none
        await h.settle()
        h.cluster.free["full"] = 1.0
        await h.settle()
        assert h.elastic.target == 2

    run(scenario())


def test_a_node_that_leaves_takes_its_engines_at_once_and_they_are_not_replaced():
    h = Harness(start=1, low=1, high=3)

    async def scenario():
        await h.start()
        h.cluster.free.update(head=0.0, n1=2.0)
        h.elastic.set_target(3)
        await h.settle()
        h.publish(1)
        events = []
        h.members.subscribe(events.append)
        h.cluster.dead.add("n1")
        await h.settle()
        assert h.state() == {"engine-0": "ready"}  # forgotten, not waiting for n1 to return
        dead = [(e.name, e.status) for e in events if e.status is S.DEAD and not e.removed]
        assert sorted(dead) == [("engine-1", S.DEAD), ("engine-2", S.DEAD)]  # requests regenerate
        assert h.elastic.target == 1 and h.elastic.lost == 2
        assert len(h.actors) == 3  # no replacement was created

    run(scenario())


def test_losses_stop_at_the_minimum_below_which_the_fleet_waits_and_then_says_what_is_missing():
    h = Harness(start=2, low=2, high=3, wait_s=30.0)

    async def scenario():
        h.fleet._actor_factory = lambda spec: h._actor(spec, "n1" if spec.name == "engine-1" else "head")  # fmt: skip
        h.cluster.free.update(n1=0.0)
        await h.start()
        h.cluster.free["head"] = 0.0
        h.cluster.dead.add("n1")
        await h.settle()
        assert h.elastic.target == 2  # the minimum: engine-1 must be placed again
        assert h.elastic.failure == ""
        h.now = 31.0
        await h.settle()
        assert h.elastic.failure.startswith(
            "rollout fleet: 1 of at least 2 engines (rollout.min_engines) running for 31s"
        )
        assert "node head: CPU 0 free of 1 needed" in h.elastic.failure
        h.cluster.free["head"] = 1.0  # room again: placed, and the clock of the wait resets
        await h.settle()
        assert "engine-1" in h.members.names() and h.node_of("engine-1") == "head"

    run(scenario())


def test_scale_down_cancels_placements_first_then_drains_the_newest_serving_engine():
    h = Harness(start=1, high=3, drain_s=5.0)

    async def scenario():
        await h.start()
        h.cluster.free.update(head=2.0)
        h.elastic.set_target(3)
        await h.settle()
        h.publish(1)
        h.in_flight["engine-2"] = 2
        h.elastic.set_target(2)
        await h.settle()
        assert h.members.status("engine-2") is S.DRAINING  # newest serving one, no new requests
        assert h.elastic.counted() == 2
        h.in_flight["engine-2"] = 0  # its requests finished there (in_place)
        await asyncio.sleep(0.5)
        assert "engine-2" not in h.members.names() and h.aborted == []
        assert h.elastic.leaves == 1
        assert [a.killed for a in h.actors if a.spec.name == "engine-2"] == [True]  # released

    run(scenario())


def test_a_drain_aborts_what_is_still_in_flight_after_its_timeout_and_at_once_in_abort_mode():
    for pause_abort, drain_s in ((False, 0.0), (True, 60.0)):
        h = Harness(start=2, low=1, high=2, pause_abort=pause_abort, drain_s=drain_s)

        async def scenario(h=h):
            await h.start()
            h.in_flight["engine-1"] = 3
            h.elastic.set_target(1)
            await h.settle()
            await asyncio.sleep(0.5)
            assert h.aborted == ["engine-1"]  # partials return and are resubmitted elsewhere
            assert h.members.names() == ["engine-0"]

        run(scenario())


def test_an_engine_that_dies_on_a_live_node_is_replaced_in_place_on_a_gone_node_lost():
    h = Harness(start=2, low=1, high=3)

    async def scenario():
        await h.start()
        h.actors[0].dead = True  # engine-0 crashes; its node (head) is alive
        await h.fleet.check_once()
        await h.fleet.wait_replacements()
        assert h.members.status("engine-0") is S.NEEDS_WEIGHTS  # a new process, same slot
        h.actors[1].dead = True
        h.cluster.dead.add("head")  # engine-1's node is gone too
        await h.fleet.check_once()
        assert "engine-1" not in h.members.names() and h.elastic.lost == 1

    run(scenario())


def test_an_engine_whose_node_goes_is_lost_once_when_its_death_report_and_a_round_both_see_it():
    h = Harness(start=1, low=1, high=3)

    async def scenario():
        await h.start()
        h.cluster.free.update(head=0.0, n1=1.0)  # n1 joins: engine-1 is placed there
        await h.settle()
        h.publish(1)
        assert h.elastic.target == 2 and h.node_of("engine-1") == "n1"
        h.cluster.dead.add("n1")
        looking = threading.Event()
        answer = threading.Event()
        fake_nodes = h.cluster.nodes

        def nodes_held_for_the_death_report():  # the report's look at the cluster waits
            h.cluster.nodes = fake_nodes
            looking.set()
            answer.wait(5)
            return fake_nodes()

        h.cluster.nodes = nodes_held_for_the_death_report
        died = asyncio.create_task(h.elastic.engine_died("engine-1", "no answer"))
        while not looking.is_set():
            await asyncio.sleep(0.01)
        await h.elastic.reconcile()  # the round sees n1 gone first
        answer.set()
        assert await died is True  # lost, not replaced
        assert h.elastic.lost == 1 and h.elastic.target == 1
        assert h.state() == {"engine-0": "ready"}

    run(scenario())


def test_a_drained_engine_that_a_publish_on_its_way_counts_on_stops_only_after_it_lands():
    h = Harness(start=2, low=1, high=2, drain_s=0.0)

    async def scenario():
        await h.start()
        targets = h.members.begin_sync(h.members.weight_targets())  # a publish to both starts
        h.elastic.set_target(1)
        await h.settle()
        await asyncio.sleep(0.5)
        assert h.members.status("engine-1") is S.DRAINING  # out of routing, still running
        assert not [a for a in h.actors if a.spec.name == "engine-1"][0].killed
        h.members.apply_sync(SyncOutcome(version=1, targets=targets.engines))  # it landed
        await asyncio.sleep(0.5)
        assert h.members.names() == ["engine-0"]
        assert h.members.status("engine-0") is S.READY  # the outcome skipped the leaver

    run(scenario())
