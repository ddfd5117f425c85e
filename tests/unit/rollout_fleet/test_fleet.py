"""Fleet manager logic with fake actors: health verdicts, replacement, the weights gate, bounds;
the states are the membership's, driven by the fleet."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.config import RolloutConfig
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import EngineStatus as EngineState
from rollout_fleet.membership import Membership, SyncOutcome
from rollout_fleet.router import Router
from tests.unit.rollout_fleet.fakes import FakeActor


class Harness:
    def __init__(self, **overrides):
        settings = {"num_engines": 2, "health_failures_before_dead": 2, "max_engine_restarts": 1}
        self.config = RolloutConfig(**{**settings, **overrides})
        self.members = Membership()
        self.router = Router(self.members)
        self.actors: list[FakeActor] = []
        self.unhealthy: set[str] = set()
        self.fail_next_start = False

    def factory(self, spec):
        actor = FakeActor(spec, fail_start=self.fail_next_start)
        self.actors.append(actor)
        return actor

    async def probe(self, url):
        return url not in self.unhealthy

    def fleet(self, weights_pushed=False):
        return EngineFleet(
            self.config,
            "/model",
            membership=self.members,
            actor_factory=self.factory,
            health_probe=self.probe,
            weights_pushed=weights_pushed,
        )


def test_start_registers_every_engine_ready_when_weights_come_from_disk():
    h = Harness()
    fleet = h.fleet()
    urls = asyncio.run(fleet.start())
    assert sorted(urls) == ["engine-0", "engine-1"]
    assert all(h.router.state(n) is EngineState.READY for n in urls)
    assert fleet.metrics()["fleet/engines_alive"] == 2


def test_sglang_with_dummy_weights_starts_engines_unroutable():
    h = Harness(backend="sglang", sglang_load_format="dummy")
    fleet = h.fleet()
    asyncio.run(fleet.start())
    assert h.router.routable() == []
    h.members.weights_loaded("engine-0", 0)
    assert h.router.routable() == ["engine-0"]


def test_under_weight_sync_every_engine_waits_for_the_first_publish():
    h = Harness()
    fleet = h.fleet(weights_pushed=True)
    asyncio.run(fleet.start())
    assert h.members.behind() == ["engine-0", "engine-1"]
    assert h.router.routable() == []


def test_dead_actor_is_replaced_and_routed_to_only_once_it_holds_the_latest_weights():
    h = Harness()

    async def scenario():
        fleet = h.fleet(weights_pushed=True)
        await fleet.start()
        h.members.apply_sync(SyncOutcome(version=4, targets=h.members.weight_targets().engines))
        victim = h.actors[0]
        victim.dead = True
        await fleet.check_once()
        assert h.router.state("engine-0") is EngineState.DEAD
        await fleet.wait_replacements()
        assert victim.killed
        new_url = f"http://engine-0/{h.actors[-1].number}"
        assert len(h.actors) == 3
        assert h.router.state("engine-0") is EngineState.NEEDS_WEIGHTS
        assert h.members.url("engine-0") == new_url
        assert h.router.routable() == ["engine-1"]
        assert fleet.metrics()["fleet/engines_alive"] == 1
        assert fleet.metrics()["fleet/engines_needing_weights"] == 1
        # the driver's rejoin publishes the latest version to the live engines
        targets = h.members.weight_targets().engines
        assert [(t.name, t.url) for t in targets][0] == ("engine-0", new_url)
        h.members.apply_sync(SyncOutcome(version=4, targets=targets))
        assert h.router.routable() == ["engine-0", "engine-1"]
        assert fleet.metrics()["fleet/engine_restarts"] == 1

    asyncio.run(scenario())


def test_without_weight_sync_a_replacement_serves_its_disk_weights_at_once():
    h = Harness()

    async def scenario():
        fleet = h.fleet()
        await fleet.start()
        h.actors[1].dead = True
        await fleet.check_once()
        await fleet.wait_replacements()
        assert h.router.state("engine-1") is EngineState.READY

    asyncio.run(scenario())


def test_failed_http_health_makes_an_engine_suspect_then_dead_after_n_failures():
    h = Harness()

    async def scenario():
        fleet = h.fleet()
        await fleet.start()
        h.unhealthy.add(fleet.urls()["engine-1"])
        await fleet.check_once()
        assert h.router.state("engine-1") is EngineState.SUSPECT
        await fleet.check_once()  # second failure = health_failures_before_dead
        await fleet.wait_replacements()
        assert h.router.state("engine-1") is EngineState.READY  # no weight sync: ready at once
        assert len(h.actors) == 3
        assert fleet.urls()["engine-1"] == f"http://engine-1/{h.actors[-1].number}"
        assert fleet.metrics()["fleet/health_failures"] == 2

    asyncio.run(scenario())


def test_one_good_check_clears_the_failure_count():
    h = Harness()

    async def scenario():
        fleet = h.fleet()
        await fleet.start()
        url = fleet.urls()["engine-0"]
        for _ in range(3):
            h.unhealthy.add(url)
            await fleet.check_once()
            h.unhealthy.discard(url)
            await fleet.check_once()
        assert len(h.actors) == 2  # never replaced

    asyncio.run(scenario())


def test_slot_stays_dead_after_its_restarts_are_spent():
    h = Harness()

    async def scenario():
        fleet = h.fleet()
        await fleet.start()
        for _ in range(3):
            for actor in h.actors:
                if actor.spec.name == "engine-0":
                    actor.dead = True
            await fleet.check_once()
            await fleet.wait_replacements()
        assert h.router.state("engine-0") is EngineState.DEAD
        assert sum(a.spec.name == "engine-0" for a in h.actors) == 2  # original + 1 restart
        assert fleet.metrics()["fleet/engines_alive"] == 1

    asyncio.run(scenario())


def test_a_replacement_that_fails_to_start_is_retried_on_the_next_round():
    h = Harness(max_engine_restarts=2)

    async def scenario():
        fleet = h.fleet()
        await fleet.start()
        h.actors[0].dead = True
        h.fail_next_start = True
        await fleet.check_once()
        await fleet.wait_replacements()
        assert h.router.state("engine-0") is EngineState.DEAD
        h.fail_next_start = False
        await fleet.check_once()  # the slot has no actor: replace again
        await fleet.wait_replacements()
        assert h.router.state("engine-0") is EngineState.READY

    asyncio.run(scenario())


def test_failing_initial_start_stops_everything_and_names_the_engine():
    h = Harness()
    h.fail_next_start = True
    fleet = h.fleet()
    with pytest.raises(RuntimeError, match="engine-0 failed to start"):
        asyncio.run(fleet.start())
    assert all(a.killed for a in h.actors)
