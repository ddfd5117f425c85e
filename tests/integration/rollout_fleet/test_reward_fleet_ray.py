"""The reward fleet on a local Ray instance with real reward-server actors (the embedded engine).

Proves: ``reward.model.num_engines`` servers start as Ray actors on nodes carrying the
reward resource and score over HTTP through ``RewardModelClient``; a killed actor is
detected by the health check and replaced, the client is told the replacement's new URL
(and stops hearing the dead one's), and scoring goes on with the same scores.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from rollout_fleet.config import RolloutConfig
from rollout_fleet.rewards.config import RewardModelConfig
from rollout_fleet.rewards.fleet import RewardFleet
from rollout_fleet.rewards.model_client import RewardModelClient

INPUTS = [[12, 13, 14], [20, 21, 22, 23, 24], [7]]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(
        address="local",
        num_cpus=2,
        resources={"reward": 1000},
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.mark.slow  # a local Ray instance plus three torch actors: ~40-90 s on 2 shared cores
def test_killed_reward_server_is_replaced_and_the_client_learns_its_url(local_ray, tiny_reward_dir):  # fmt: skip
    rollout = RolloutConfig(
        health_check_timeout_s=10, health_failures_before_dead=2, engine_startup_timeout_s=120
    )
    model = RewardModelConfig(path=str(tiny_reward_dir), num_engines=2, cpus_per_engine=0.5)
    client = RewardModelClient.from_config(model, {}, api_key=None)
    told: list[dict[str, str]] = []

    def on_servers(servers) -> None:
        told.append(dict(servers))
        client.set_servers(servers)

    async def scenario():
        fleet = RewardFleet(model, rollout, on_servers=on_servers, resource_name="reward")
        try:
            first = await fleet.start()
            assert sorted(first) == ["reward-0", "reward-1"] and client.servers == first
            before = await client.score(INPUTS)

            ray.kill(fleet.fleet._slots["reward-0"].actor, no_restart=True)
            for _ in range(50):
                await fleet.check_once()
                if "reward-0" not in client.servers:
                    break
                await asyncio.sleep(0.1)
            assert client.servers == {"reward-1": first["reward-1"]}
            await fleet.wait_replacements()
            assert sorted(client.servers) == ["reward-0", "reward-1"]
            assert client.servers["reward-0"] != first["reward-0"] and told[-1] == client.servers
            after = await client.score(INPUTS * 3)
            return before, after, fleet.metrics()
        finally:
            await client.aclose()
            await fleet.stop()

    before, after, metrics = asyncio.run(scenario())
    assert after == pytest.approx(before * 3, abs=1e-5)
    assert metrics["reward_fleet/engine_restarts"] == 1
    assert metrics["reward_fleet/engines_alive"] == 2
