"""The reward pipeline built from the run config's ``reward`` section: the custom function from
its file, the reward-model scorer from its folder (tokenizer, statistics, context) and the
servers mapping, judge access wired to both, and how rule and model scores combine."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from fleetrl.config import ConfigError
from fleetrl.models.reward_folder import RewardStats, write_reward_stats
from fleetrl.models.tiny import make_tiny_model
from rollout_fleet.rewards.config import RewardConfig
from rollout_fleet.rewards.model_scorer import servers_from_urls
from rollout_fleet.rewards.pipeline import RewardPipeline, build_reward_pipeline
from rollout_fleet.rewards.runner import RewardRunner
from tests.unit.rollout_fleet.fakes import prompt
from tests.unit.rollout_fleet.reward_fakes import FakeRewardFleet
from tests.unit.rollout_fleet.test_worker_rewards import model_pipeline

JUDGE = """
def compute_score(data_source, solution_str, ground_truth, extra_info, reward_servers, reward_api_key, engine_urls):
    return {"score": 1.0, "servers": float(len(reward_servers)), "engines": float(len(engine_urls)),
            "keyed": float(reward_api_key == "secret")}
"""


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp("rm") / "rm", layers=1, hidden=16, heads=2, max_positions=48,
        reward_model=True,
    )  # fmt: skip
    write_reward_stats(folder, RewardStats(mean=2.0, std=4.0, pairs=10))
    return folder


def config(**sections) -> RewardConfig:
    return msgspec.convert(sections, RewardConfig)


def test_the_pipeline_reads_the_folder_and_hands_judges_the_servers_and_engines(
    tmp_path, reward_folder
):
    fleet = FakeRewardFleet(count=2)
    path = tmp_path / "judge.py"
    path.write_text(JUDGE)
    cfg = config(
        custom_function={"path": str(path)},
        rule_weight=0.5,
        model={"path": str(reward_folder), "urls": fleet.urls, "weight": 2.0, "clip": 1.0},
    )
    pipeline = build_reward_pipeline(
        cfg, timeout_s=5, max_workers=1, model_servers=servers_from_urls(fleet.urls),
        reward_api_key="secret", engines=lambda: {"engine-0": "http://e:1"},
        client_factory=fleet.client_factory,
    )  # fmt: skip
    assert pipeline.model is not None
    assert pipeline.model.inputs.max_length == 48  # the folder's max_position_embeddings
    assert pipeline.model.normalization == RewardStats(mean=2.0, std=4.0, pairs=10)
    client = fleet.clients[0]
    assert (client.api_key, client.batch_size, client.max_attempts) == ("secret", 64, 4)
    item = prompt(0, "any/source")
    rule = asyncio.run(pipeline.rule_score(item, "12"))
    assert rule.metrics == {"servers": 2.0, "engines": 1.0, "keyed": 1.0}
    (reward,) = asyncio.run(pipeline.score_group(item, ["12"], [rule]))
    raw = reward.metrics["model_score_raw"]
    assert reward.metrics["model_score"] == pytest.approx(max(-1.0, min(1.0, (raw - 2.0) / 4.0)))
    assert reward.score == pytest.approx(0.5 * 1.0 + 2.0 * reward.metrics["model_score"])


def test_a_batched_function_waits_for_its_group_and_scores_it_in_one_call(tmp_path):
    path = tmp_path / "batched.py"
    path.write_text(
        "CALLS = []\n"
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    CALLS.append(len(solution_strs))\n"
        "    return [float(len(s)) for s in solution_strs]\n"
    )
    pipeline = build_reward_pipeline(
        config(custom_function={"path": str(path)}), timeout_s=5, max_workers=1
    )
    item = prompt(0)
    assert asyncio.run(pipeline.rule_score(item, "abc")) is None  # deferred to the group
    rewards = asyncio.run(pipeline.score_group(item, ["a", "abc", "ab"], [None, None, None]))
    assert [r.score for r in rewards] == [1.0, 3.0, 2.0]
    assert pipeline.rules.custom is not None
    assert pipeline.rules.custom.fn.__globals__["CALLS"] == [3]


def test_scores_combine_by_weight_and_a_needed_term_that_failed_fails_the_sample():
    fleet = FakeRewardFleet(count=1)

    def rule(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "bad":
            raise ValueError("no")
        return 1.0

    weighted = model_pipeline(fleet, rule_fn=rule, rule_weight=0.25, weight=3.0)
    item = prompt(0)
    rules = [asyncio.run(weighted.rule_score(item, t)) for t in ("ok", "bad")]
    ok, bad = asyncio.run(weighted.score_group(item, ["ok", "bad"], rules))
    assert ok.score == pytest.approx(0.25 + 3.0 * ok.metrics["model_score"])
    assert bad.failed and bad.error.startswith("rule: raised ValueError('no')")
    assert "model_score" in bad.metrics  # what did score is kept for analysis
    model_only = model_pipeline(fleet, rule_fn=rule, rule_weight=0.0)
    rules = [asyncio.run(model_only.rule_score(item, t)) for t in ("ok", "bad")]
    ok, bad = asyncio.run(model_only.score_group(item, ["ok", "bad"], rules))
    assert not bad.failed and bad.score == pytest.approx(bad.metrics["model_score"])
    assert model_only.stats()["reward/rule_failed"] == 1.0  # counted all the same


def test_a_reward_model_weighted_zero_fails_no_sample():
    """Its score is reported for analysis (a model watched, not trained on), and its
    failures are counted; the rule alone decides the reward."""
    fleet = FakeRewardFleet(count=1)
    for server in fleet.servers.values():
        server.mode = "dead"
    watched = model_pipeline(fleet, rule_fn=lambda **_: 1.0, rule_weight=1.0, weight=0.0)
    item = prompt(0)
    rules = [asyncio.run(watched.rule_score(item, t)) for t in ("a", "b")]
    rewards = asyncio.run(watched.score_group(item, ["a", "b"], rules))
    assert [(r.failed, r.score) for r in rewards] == [(False, 1.0), (False, 1.0)]
    stats = watched.stats()
    assert stats["reward/model_failed"] == 2.0 and stats["reward/samples_failed"] == 0.0


def test_a_rule_weight_of_zero_needs_a_reward_model():
    with pytest.raises(ValueError, match="rule_weight is 0 and there is no reward model"):
        RewardPipeline(RewardRunner(5, 1), None, rule_weight=0.0)


def test_a_file_or_folder_that_cannot_work_is_a_config_error_naming_its_key(tmp_path):
    missing = config(custom_function={"path": str(tmp_path / "absent.py")})
    with pytest.raises(
        ConfigError, match=r"^config error at reward.custom_function.path: .*absent"
    ):
        build_reward_pipeline(missing, timeout_s=5, max_workers=1)
    policy = make_tiny_model(tmp_path / "policy", layers=1, hidden=16, heads=2)
    not_rm = config(model={"path": str(policy), "urls": ["http://127.0.0.1:1"]})
    with pytest.raises(ConfigError, match=r"^config error at reward.model.path: .*ForSequence"):
        build_reward_pipeline(not_rm, timeout_s=5, max_workers=1, client_factory=FakeRewardFleet().client_factory)  # fmt: skip
