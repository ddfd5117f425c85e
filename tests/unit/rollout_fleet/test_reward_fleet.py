"""The reward fleet with fake actors: the servers' specs per backend, their supervision settings,
READY at once (no weight push), and whoever scores told every serving URL as servers die and
are replaced (the replacement's new URL included, the dead one's gone)."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.config import RolloutConfig
from rollout_fleet.membership import EngineStatus
from rollout_fleet.rewards.config import RewardModelConfig
from rollout_fleet.rewards.fleet import (
    RewardFleet,
    reward_backend,
    reward_fleet_settings,
    reward_server_specs,
)
from tests.unit.rollout_fleet.fakes import FakeActor

RM = "/models/rm"


def test_auto_backend_follows_the_rollout_backend():
    model = RewardModelConfig(path=RM)
    assert reward_backend(model, RolloutConfig(backend="sglang")) == "sglang"
    assert reward_backend(model, RolloutConfig(backend="embedded")) == "embedded"
    forced = RewardModelConfig(path=RM, backend="embedded")
    assert reward_backend(forced, RolloutConfig(backend="sglang")) == "embedded"


def test_embedded_specs_score_a_client_batch_per_forward_on_the_cpu():
    model = RewardModelConfig(path=RM, num_engines=2, cpus_per_engine=2, batch_size=32)
    specs = reward_server_specs(model, RolloutConfig(), api_key="k", expose_on_node_ip=True)
    assert [s.name for s in specs] == ["reward-0", "reward-1"]
    for spec in specs:
        assert spec.backend == "embedded" and spec.device == "cpu" and spec.is_embedding
        assert spec.max_running_requests == 32 and spec.torch_threads == 2
        assert spec.api_key == "k" and spec.expose_on_node_ip and spec.model_path == RM
        spec.validate()


def test_sglang_specs_load_their_own_weights_with_is_embedding_and_tp_over_their_gpus():
    model = RewardModelConfig(
        path=RM,
        backend="sglang",
        gpus_per_engine=2,
        mem_fraction_static=0.5,
        sglang_extra_args=["--attention-backend", "fa3"],
    )
    (spec,) = reward_server_specs(model, RolloutConfig())
    assert spec.backend == "sglang" and spec.device == "cuda" and spec.tp_size == 2
    assert spec.load_format == "auto" and spec.is_embedding
    assert spec.max_running_requests is None and spec.mem_fraction_static == 0.5
    assert spec.extra_args == ["--attention-backend", "fa3"]


def test_settings_take_counts_and_resources_from_reward_and_health_from_rollout():
    rollout = RolloutConfig(health_check_interval_s=2.0, max_engine_restarts=5, cpus_per_engine=7)
    model = RewardModelConfig(path=RM, num_engines=3, cpus_per_engine=0.5, gpus_per_engine=1)
    settings = reward_fleet_settings(model, rollout)
    assert (settings.num_engines, settings.cpus_per_engine, settings.gpus_per_engine) == (3, 0.5, 1)  # fmt: skip
    assert settings.health_check_interval_s == 2.0 and settings.max_engine_restarts == 5
    assert settings.weights_from_disk and settings.metrics_prefix == "reward_fleet"


async def healthy(url: str) -> bool:
    return True


@pytest.fixture
def harness():
    seen: list[dict[str, str]] = []
    actors: list[FakeActor] = []

    def factory(spec):
        actors.append(FakeActor(spec))
        return actors[-1]

    rollout = RolloutConfig(health_failures_before_dead=1, max_engine_restarts=2)
    fleet = RewardFleet(
        RewardModelConfig(path=RM, num_engines=2),
        rollout,
        on_servers=lambda servers: seen.append(dict(servers)),
        actor_factory=factory,
        health_probe=healthy,
    )
    return fleet, seen, actors


def test_servers_are_ready_at_once_and_the_client_hears_each(harness):
    fleet, seen, actors = harness
    servers = asyncio.run(fleet.start())
    assert sorted(servers) == ["reward-0", "reward-1"]
    assert all(fleet.membership.status(n) is EngineStatus.READY for n in servers)
    assert seen[-1] == servers == {a.spec.name: f"http://{a.spec.name}/{a.number}" for a in actors}
    assert fleet.metrics()["reward_fleet/engines_alive"] == 2


def test_a_dead_server_leaves_the_pool_and_its_replacement_joins_with_its_new_url(harness):
    fleet, seen, actors = harness

    async def scenario():
        first = await fleet.start()
        actors[0].dead = True
        await fleet.check_once()
        await fleet.wait_replacements()
        return first

    first = asyncio.run(scenario())
    assert {"reward-1": first["reward-1"]} in seen  # it left the pool while replaced
    replacement = actors[-1]
    assert replacement.spec.name == "reward-0" and actors[0].killed
    assert seen[-1] == {"reward-0": f"http://reward-0/{replacement.number}", "reward-1": first["reward-1"]}  # fmt: skip
    assert seen[-1]["reward-0"] != first["reward-0"]
    metrics = fleet.metrics()
    assert metrics["reward_fleet/engine_restarts"] == 1 and metrics["reward_fleet/engines_alive"] == 2  # fmt: skip
