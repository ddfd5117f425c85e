"""The rollout worker's rewards: rule scores as samples finish, the reward model once per
group, combined by weight; failed rewards marked on the wire, all-failed groups dropped and
counted; validation reports the combined, rule and model scores per data source.

Engines and reward servers are in-process fakes (fakes.py, reward_fakes.py).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from fleetrl.models.tiny import build_tokenizer
from rollout_fleet.rewards.model_input import RewardModelInputs
from rollout_fleet.rewards.model_scorer import ModelScorer, servers_from_urls
from rollout_fleet.rewards.pipeline import RewardPipeline
from rollout_fleet.rewards.runner import RewardRunner
from tests.unit.rollout_fleet.fakes import FakeEngine, fake_rewards, prompt
from tests.unit.rollout_fleet.reward_fakes import FakeRewardFleet
from tests.unit.rollout_fleet.test_worker import make_ledger, make_worker

# FakeEngine's responses are tokens 100, 101, ...: FakeTokenizer decodes them "100 101 ..."


def fails_on_token_102(data_source, solution_str, ground_truth, extra_info):
    if "102" in solution_str:
        raise ValueError("cannot grade")
    return 1.0


def model_pipeline(fleet: FakeRewardFleet, *, rule_fn=None, rule_weight=1.0, weight=1.0):
    client = fleet.client_factory(
        servers_from_urls(fleet.urls), api_key=None, batch_size=64, request_timeout_s=1.0,
        max_attempts=2, retry_backoff_s=0.0,
    )  # fmt: skip
    inputs = RewardModelInputs(build_tokenizer(), apply_chat_template="on", max_length=512)
    model = ModelScorer(client, inputs)
    rules = RewardRunner(5, 2, rule_fn) if rule_fn is not None else RewardRunner(5, 2)
    return RewardPipeline(rules, model, rule_weight=rule_weight, model_weight=weight)


def test_a_group_whose_every_reward_fails_is_dropped_and_counted_not_sent():
    # every response is "100 101 102": the reward of every sample fails
    worker, _, sender = make_worker(
        [FakeEngine("a")], n=2, max_new_tokens=3, prompts=[prompt(0), prompt(1)],
        rewards=fake_rewards(fails_on_token_102),
    )  # fmt: skip
    asyncio.run(worker.run(num_groups=2))
    assert sender.trajectories == []
    metrics = worker.metrics()
    assert metrics["reward/groups_failed"] == 2.0
    assert metrics["reward/samples_failed"] == 4.0
    assert metrics["rollout/groups_finished"] == 0.0


def test_groups_whose_every_reward_fails_in_a_row_give_the_reason_to_stop():
    def always_raises(data_source, solution_str, ground_truth, extra_info):
        raise KeyError("difficulty")

    def failing_worker(limit: int):
        worker, _, _ = make_worker(
            [FakeEngine("a")], n=2, prompts=[prompt(i) for i in range(4)],
            rewards=fake_rewards(always_raises), max_failed_reward_groups=limit,
        )  # fmt: skip
        asyncio.run(worker.run(num_groups=4))
        return worker

    worker = failing_worker(5)
    assert worker.reward_streak.stop_reason is None  # 4 of 5: not yet
    assert worker.metrics()["reward/groups_failed_in_a_row"] == 4.0
    assert failing_worker(0).reward_streak.stop_reason is None  # 0: never
    worker = failing_worker(4)
    assert worker.reward_streak.stop_reason == (
        "the reward failed on every sample of 4 groups in a row (reward.max_failed_groups=4); "
        "the last error: rule: raised KeyError('difficulty')"
    )


def test_a_reward_server_that_stays_down_gives_the_reason_to_stop_the_same_way():
    import socket

    from rollout_fleet.rewards.model_client import RewardModelClient

    with socket.socket() as probe:  # a port nothing listens on: every request is refused
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    client = RewardModelClient(
        servers_from_urls([url]), api_key=None, batch_size=8, request_timeout_s=1.0,
        max_attempts=2, retry_backoff_s=0.0,
    )  # fmt: skip
    inputs = RewardModelInputs(build_tokenizer(), apply_chat_template="on", max_length=512)
    rewards = RewardPipeline(RewardRunner(5, 2), ModelScorer(client, inputs), rule_weight=0.0, model_weight=1.0)  # fmt: skip
    worker, _, sender = make_worker(
        [FakeEngine("a")], n=2, prompts=[prompt(i) for i in range(3)], rewards=rewards,
        max_failed_reward_groups=3,
    )  # fmt: skip
    asyncio.run(worker.run(num_groups=3))
    reason = worker.reward_streak.stop_reason
    assert sender.trajectories == [] and reason is not None
    assert reason.startswith("the reward failed on every sample of 3 groups in a row")
    assert "reward-url-0" in reason  # the client's error names the server that is down


def test_a_group_with_any_sample_scored_ends_the_streak():
    calls = []

    def fails_but_every_fifth(data_source, solution_str, ground_truth, extra_info):
        calls.append(1)
        if len(calls) % 5:
            raise ValueError("flaky")
        return 1.0

    worker, _, _ = make_worker(
        [FakeEngine("a")], n=2, prompts=[prompt(i) for i in range(6)],
        rewards=fake_rewards(fails_but_every_fifth), max_failed_reward_groups=3,
    )  # fmt: skip
    asyncio.run(worker.run(num_groups=6))
    assert worker.groups_reward_failed >= 3 and worker.reward_streak.stop_reason is None


def test_a_failed_sample_travels_with_its_group_marked_and_scored_zero():
    calls = []

    def fails_second_call(data_source, solution_str, ground_truth, extra_info):
        calls.append(solution_str)
        if len(calls) == 2:
            raise ZeroDivisionError("bad luck")
        return 0.75

    worker, _, sender = make_worker(
        [FakeEngine("a")], n=3, prompts=[prompt(0)], rewards=fake_rewards(fails_second_call)
    )
    asyncio.run(worker.run(num_groups=1))
    trajs = sender.trajectories
    assert len(trajs) == 3 and len({t.group_id for t in trajs}) == 1
    failed = [t for t in trajs if t.reward_failed]
    assert len(failed) == 1
    assert "rule: raised ZeroDivisionError('bad luck')" in failed[0].reward_error
    assert failed[0].score == 0.0 and "rule_score" not in failed[0].reward_metrics
    assert sorted(t.score for t in trajs if not t.reward_failed) == [0.75, 0.75]
    metrics = worker.metrics()
    assert (metrics["reward/samples_failed"], metrics["reward/groups_failed"]) == (1.0, 0.0)


def test_the_reward_model_scores_each_group_in_one_call_combined_with_the_rule():
    fleet = FakeRewardFleet(count=1)
    rewards = model_pipeline(fleet, rule_fn=lambda **kw: 1.0, rule_weight=0.5, weight=2.0)
    worker, _, sender = make_worker([FakeEngine("a")], n=4, prompts=[prompt(0), prompt(1)], rewards=rewards)  # fmt: skip
    asyncio.run(worker.run(num_groups=2))
    server = fleet.servers[fleet.urls[0]]
    assert server.requests == 2  # one /classify batch per group of 4
    assert sum(server.scored.values()) == 8
    for t in sender.trajectories:
        m = t.reward_metrics
        assert m["rule_score"] == 1.0 and m["model_score"] == m["model_score_raw"]
        assert t.score == pytest.approx(0.5 * 1.0 + 2.0 * m["model_score"])
        assert t.timings["reward_group_s"] >= 0.0
    stats = worker.metrics()
    scores = [t.reward_metrics["model_score"] for t in sender.trajectories]
    assert stats["reward/model_score/mean"] == pytest.approx(sum(scores) / len(scores))
    assert stats["reward_model/items"] == 8.0
    assert stats["reward/rule_score/mean"] == 1.0
    again = worker.metrics()  # the means cover the samples scored since the previous read
    assert "reward/rule_score/mean" not in again and again["reward/samples_scored"] == 8.0


def test_with_rule_weight_zero_no_rule_is_needed_but_an_existing_one_is_reported():
    fleet = FakeRewardFleet(count=1)
    rewards = model_pipeline(fleet, rule_weight=0.0)  # built-in scorers only: synth/* exists
    rows = [prompt(0, "synth/add"), prompt(1, "no/rule/for/this")]
    worker, _, sender = make_worker([FakeEngine("a")], n=2, prompts=rows, rewards=rewards)
    asyncio.run(worker.run(num_groups=2))
    by_source = {t.data_source: t for t in sender.trajectories}
    assert len(sender.trajectories) == 4 and not any(t.reward_failed for t in sender.trajectories)
    synth = by_source["synth/add"]
    assert "rule_score" in synth.reward_metrics  # computed and reported, weighted 0
    assert synth.score == pytest.approx(synth.reward_metrics["model_score"])
    assert "rule_score" not in by_source["no/rule/for/this"].reward_metrics


def test_an_unknown_data_source_fails_its_samples_when_the_rule_counts():
    worker, _, sender = make_worker(
        [FakeEngine("a")],
        n=2,
        prompts=[prompt(0, "no/rule")],
        rewards=RewardPipeline(RewardRunner(5, 1)),
    )
    asyncio.run(worker.run(num_groups=1))
    assert sender.trajectories == []  # both samples failed: the group is dropped
    assert worker.metrics()["reward/groups_failed"] == 1.0


def test_an_all_failed_group_is_forgotten_by_the_ledger_not_awaited():
    from tests.unit.rollout_fleet.fakes import CollectingSender

    sender = CollectingSender()
    prompts = [prompt(0), prompt(1)]
    ledger, _counts = make_ledger(sender, prompts, n=2)
    fleet = FakeRewardFleet(count=1)
    fleet.servers[fleet.urls[0]].mode = "dead"
    worker, _, _ = make_worker(
        [FakeEngine("a")], n=2, ledger=ledger, prompts=prompts, rewards=model_pipeline(fleet)
    )
    asyncio.run(worker.run(num_groups=2))
    assert sender.trajectories == []
    assert ledger.sent_unconfirmed() == 0 and worker.running_groups == 0
    assert worker.metrics()["reward/groups_failed"] == 2.0


def test_validation_reports_combined_rule_and_model_scores_per_data_source():
    fleet = FakeRewardFleet(count=1)
    rewards = model_pipeline(fleet, rule_fn=lambda **kw: 1.0, rule_weight=1.0, weight=1.0)
    worker, _, _ = make_worker([FakeEngine("a")], n=4, rewards=rewards)
    rows = [prompt(0, "src/a"), prompt(1, "src/a"), prompt(2, "src/b")]
    out = asyncio.run(worker.validate(rows)).metrics
    assert out["val/num_samples"] == 3 and out["val/num_reward_failed"] == 0
    assert out["val/rule_score/mean"] == 1.0 and out["val/rule_score/src/b"] == 1.0
    model = out["val/model_score/src/a"]
    assert math.isfinite(model)
    assert out["val/score/src/a"] == pytest.approx(1.0 + model)
    assert out["val/score/mean"] == pytest.approx(
        (2 * out["val/score/src/a"] + out["val/score/src/b"]) / 3
    )
    # verl's names beside ours: the combined reward as val-core, the parts as val-aux
    assert out["val-core/src/a/reward/mean@1"] == pytest.approx(out["val/score/src/a"])
    assert out["val-aux/src/b/rule_score/mean@1"] == 1.0
    # validation leaves the run's reward counters and per-step means alone
    assert worker.metrics()["reward/samples_scored"] == 0.0
