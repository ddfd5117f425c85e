"""Which reward servers a run scores on: none without a reward model; reward.model.urls with
their own key (the driver reads api_key_env) and no fleet; a placed fleet (the run's key) feeding the client."""

from __future__ import annotations

import pytest

from rollout_fleet.config import RolloutConfig
from rollout_fleet.rewards.config import RewardConfig, RewardModelConfig
from rollout_fleet.rewards.servers import RewardServers


def test_no_reward_model_means_no_servers():
    assert RewardServers.for_run(RewardConfig(), RolloutConfig(), api_key="run") is None


def test_urls_score_on_the_running_servers_with_their_own_key():
    model = RewardModelConfig(
        path="/rm",
        urls=["http://10.0.0.5:30001/", "http://10.0.0.6:30001"],
        api_key_env="MY_RM_KEY",
    )
    servers = RewardServers.for_run(
        RewardConfig(model=model), RolloutConfig(), api_key="run", url_api_key="their-key"
    )
    assert servers.fleet is None and servers.client.api_key == "their-key"
    assert servers.client.servers == {
        "reward-url-0": "http://10.0.0.5:30001",
        "reward-url-1": "http://10.0.0.6:30001",
    }


def test_a_path_alone_places_a_fleet_whose_servers_the_client_is_told(monkeypatch):
    model = RewardModelConfig(path="/rm", num_engines=2, batch_size=16, max_attempts=7)
    servers = RewardServers.for_run(RewardConfig(model=model), RolloutConfig(), api_key="run")
    assert servers.fleet is not None and servers.client.servers == {}  # filled in by the fleet
    assert servers.client.api_key == "run" and servers.client.batch_size == 16
    assert servers.client.max_attempts == 7
    specs = [slot.spec for slot in servers.fleet.fleet._slots.values()]
    assert [s.name for s in specs] == ["reward-0", "reward-1"] and all(
        s.api_key == "run" for s in specs
    )
    servers.fleet.membership.launch("reward-0", "http://127.0.0.1:5000")
    servers.fleet.membership.weights_loaded("reward-0", 0)
    assert servers.client.servers == {"reward-0": "http://127.0.0.1:5000"}
    metrics = servers.metrics()
    assert metrics["reward_fleet/engines_alive"] == 1 and metrics["reward_model/servers"] == 1


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"max_attempts": 0}, {"request_timeout_s": 0}])
def test_the_client_refuses_settings_that_cannot_score(bad):
    from rollout_fleet.rewards.model_client import RewardModelClient

    settings = dict(
        api_key=None, batch_size=4, request_timeout_s=1.0, max_attempts=2, retry_backoff_s=0
    )
    settings.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        RewardModelClient({}, **settings)
