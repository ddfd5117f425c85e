"""EngineFleet on a local Ray instance with real embedded-engine actors.

Proves: engines start as Ray actors and serve HTTP; a killed actor is detected
by the health check, marked dead in the router, replaced by a new actor whose
URL reaches the restart hook while the engine is still unroutable, and becomes
routable only when marked ready; the worker then generates on the fleet.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from rollout_fleet.client import EngineClient
from rollout_fleet.config import RolloutConfig
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import EngineStatus, Membership, SyncOutcome


@pytest.fixture(scope="module")
def local_ray():
    ray.init(
        address="local",  # not a cluster `ray start` left recorded in /tmp/ray
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.mark.slow  # a local Ray instance plus three torch actors: ~40-80 s on 2 shared cores
def test_killed_engine_actor_is_replaced_and_gated_until_ready(local_ray, tiny_model_dir):
    config = RolloutConfig(
        num_engines=2,
        cpus_per_engine=0.5,
        max_running_requests=8,
        health_check_timeout_s=10,
        health_failures_before_dead=2,
        engine_startup_timeout_s=120,
    )
    members = Membership()

    def publish_to_all() -> None:  # as a weight-sync publish reporting success would
        members.apply_sync(SyncOutcome(version=0, targets=members.weight_targets().engines))

    async def scenario():
        fleet = EngineFleet(config, str(tiny_model_dir), membership=members, weights_pushed=True)
        try:
            urls = await fleet.start()
            assert sorted(urls) == ["engine-0", "engine-1"]
            assert all(u.startswith("http://127.0.0.1:") for u in urls.values())
            publish_to_all()
            await fleet.check_once()
            assert fleet.metrics()["fleet/engines_alive"] == 2

            ray.kill(fleet._slots["engine-0"].actor, no_restart=True)
            for _ in range(50):
                await fleet.check_once()
                if members.status("engine-0") is not EngineStatus.READY:
                    break
                await asyncio.sleep(0.1)
            await fleet.wait_replacements()

            assert members.status("engine-0") is EngineStatus.NEEDS_WEIGHTS
            new_url = members.url("engine-0")
            assert new_url != urls["engine-0"]
            assert [n for n, _, _ in members.routable()] == ["engine-1"]
            async with EngineClient(new_url, timeout_s=10) as client:
                assert await client.health()
            publish_to_all()
            assert [n for n, _, _ in members.routable()] == ["engine-0", "engine-1"]
            metrics = fleet.metrics()
            assert metrics["fleet/engines_alive"] == 2
            assert metrics["fleet/engine_restarts"] == 1
        finally:
            await fleet.stop()

    asyncio.run(scenario())
