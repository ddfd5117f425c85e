"""Reward faults, end to end from the rollout worker through the buffer to the learner's batch.

A reward server that dies mid-run, one that hangs, NaN and infinite scores, a reply with
the wrong number of scores, a custom function that raises on one sample. Each test counts
on the trajectories the buffer holds: samples lost (groups started but neither held nor
counted as dropped), scored twice (a sample with two scores, a uid twice, a server scoring
an input more often than samples carry it), and failures marked and counted; the learner's
view of the buffer's batch shows a failed sample trains nothing.

The server scenarios run twice (``fleet_kind``): on in-process fakes of the servers and
their client (reward_fakes.py), and over the wire on hostile aiohttp servers on loopback
answering ``/classify`` in SGLang's reply shape, through the real client
(rollout_fleet/rewards/model_client.py; skipped where that module is not in the tree).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import numpy as np
import pytest

from buffer.arrow_batch import from_ipc
from buffer.config import BufferConfig
from buffer.core import BufferCore
from fleetrl.data.reader import PromptItem
from fleetrl.models.tiny import build_tokenizer
from learner.batching import GlobalBatch
from rollout_fleet.rewards.model_input import RewardModelInputs
from rollout_fleet.rewards.model_scorer import ModelScorer, servers_from_urls
from rollout_fleet.rewards.pipeline import RewardPipeline
from rollout_fleet.rewards.runner import RewardRunner
from tests.unit.rollout_fleet.fakes import FakeEngine
from tests.unit.rollout_fleet.reward_fakes import FakeRewardFleet, HttpRewardFleet, length_score
from tests.unit.rollout_fleet.test_worker import make_worker

N = 4  # samples per group
GROUPS = 8
# Timeouts: a healthy reply never comes near them, on a loaded machine too; a hung
# server's costs one per batch sent to it


def item(index: int) -> PromptItem:
    return PromptItem(
        index=index,
        prompt_ids=np.arange(10 + index, 13 + index, dtype=np.int32),
        data_source="synth/add",
        ground_truth="1",
        extra_info={},
        raw_prompt=[{"role": "user", "content": f"question {index}"}],  # one RM input per group
    )


class BufferSink:
    """The worker's sender, ingesting into an in-process buffer (as the ZeroMQ service does)."""

    def __init__(self, core: BufferCore) -> None:
        self.core = core
        self.trajectories: list = []

    def send(self, traj) -> None:
        self.trajectories.append(traj)
        self.core.ingest([traj])


@pytest.fixture(params=["fake", "http"])
def make_fleet(request):
    """``make_fleet(count)``: reward servers and a client for them, of the parameter's kind."""
    if request.param == "http":
        pytest.importorskip("rollout_fleet.rewards.model_client")
    fleets = []

    def make(count: int, score_fn=length_score):
        kind = FakeRewardFleet if request.param == "fake" else HttpRewardFleet
        fleets.append(kind(count, score_fn=score_fn))
        return fleets[-1]

    yield make
    for fleet in fleets:
        if isinstance(fleet, HttpRewardFleet):
            fleet.close()


def pipeline(fleet, *, timeout_s=10.0, attempts=3, rule=None) -> RewardPipeline:
    client = fleet.client_factory(
        servers_from_urls(fleet.urls), api_key=None, batch_size=64, request_timeout_s=timeout_s,
        max_attempts=attempts, retry_backoff_s=0.0,
    )  # fmt: skip
    inputs = RewardModelInputs(build_tokenizer(), apply_chat_template="on", max_length=512)
    model = ModelScorer(client, inputs)
    rules = RewardRunner(5, 2, rule) if rule is not None else RewardRunner(5, 2)
    return RewardPipeline(rules, model, rule_weight=0.0 if rule is None else 1.0)


def run(tmp_path, rewards: RewardPipeline, groups: int = GROUPS):
    core = BufferCore(
        BufferConfig(max_staleness=4), bank_dir=tmp_path / "bank", groups_per_version=1000,
        max_concurrent_groups=64,
    )  # fmt: skip
    sink = BufferSink(core)
    worker, _, _ = make_worker(
        [FakeEngine("a")], n=N, sender=sink, prompts=[item(i) for i in range(groups)],
        rewards=rewards,
    )  # fmt: skip

    async def scenario():
        try:
            await worker.run(num_groups=groups)
        finally:
            await rewards.aclose()  # the client's HTTP session, on the loop that opened it

    asyncio.run(scenario())
    return core, sink, worker.metrics()


def held(core: BufferCore) -> list:
    """Every trajectory the buffer holds, read back from its bank."""
    return [t for _, batch in core.bank.iter_trajectories() for t in batch]


def learner_view(core: BufferCore, groups: int) -> GlobalBatch:
    taken = core.take_batch(groups, learner_version=0)
    assert taken is not None
    return GlobalBatch.from_arrow(from_ipc(taken[0].arrow_ipc))


def check_exactly_once(core, fleet, metrics, groups=GROUPS):
    trajs = held(core)
    per_group = Counter(t.group_id for t in trajs)
    dropped = int(metrics["reward/groups_failed"])
    assert len(per_group) + dropped == groups  # 0 lost: every group held or counted dropped
    assert all(count == N for count in per_group.values())
    assert len({t.uid for t in trajs}) == len(trajs)  # 0 twice in the buffer
    scored = [t for t in trajs if not t.reward_failed]
    assert all("model_score" in t.reward_metrics for t in scored)
    # each input scored by the servers once per sample that carries it: never twice
    per_input = fleet.scored_items()
    assert sum(per_input.values()) == len(scored)
    assert set(per_input.values()) <= {N}
    return trajs


def test_a_server_killed_mid_run_loses_and_doubles_nothing(tmp_path, make_fleet):
    fleet = make_fleet(2)
    first = fleet.servers[fleet.urls[0]]
    first.fail_after = 2  # answers two batches, then its process is gone
    core, _, metrics = run(tmp_path, pipeline(fleet))
    trajs = check_exactly_once(core, fleet, metrics)
    assert len(trajs) == GROUPS * N and not any(t.reward_failed for t in trajs)
    assert metrics["reward/groups_failed"] == 0 and metrics["reward/samples_failed"] == 0
    assert first.mode == "dead" and sum(first.scored.values()) == 2 * N
    assert metrics["reward_model/failovers"] >= 1  # its later batches went to the other one


def test_a_hung_server_times_out_and_its_batches_fail_over(tmp_path, make_fleet):
    fleet = make_fleet(2)
    fleet.servers[fleet.urls[0]].mode = "hang"
    core, _, metrics = run(tmp_path, pipeline(fleet, timeout_s=1.0))
    trajs = check_exactly_once(core, fleet, metrics)
    assert len(trajs) == GROUPS * N
    assert metrics["reward_model/timeouts"] >= 1 and metrics["reward/samples_failed"] == 0


def test_with_every_server_hung_the_samples_fail_counted_and_the_run_goes_on(tmp_path, make_fleet):
    fleet = make_fleet(1)
    fleet.servers[fleet.urls[0]].mode = "hang"
    core, sink, metrics = run(tmp_path, pipeline(fleet, timeout_s=0.5, attempts=2), groups=3)
    check_exactly_once(core, fleet, metrics, groups=3)
    assert sink.trajectories == [] and held(core) == []
    assert metrics["reward/groups_failed"] == 3 and metrics["reward/samples_failed"] == 3 * N
    assert metrics["reward_model/timeouts"] == 3 * 2


def test_a_wrong_reply_count_on_every_server_fails_the_groups(tmp_path, make_fleet):
    fleet = make_fleet(2)
    for server in fleet.servers.values():
        server.mode = "wrong_count"
    core, _, metrics = run(tmp_path, pipeline(fleet), groups=2)
    check_exactly_once(core, fleet, metrics, groups=2)
    assert held(core) == [] and metrics["reward/groups_failed"] == 2
    assert metrics["reward_model/bad_replies"] == 2 * 3  # three attempts per batch


def test_nan_scores_on_every_server_fail_every_sample_and_so_the_groups(tmp_path, make_fleet):
    fleet = make_fleet(2)
    for server in fleet.servers.values():
        server.mode = "nan"
    core, _, metrics = run(tmp_path, pipeline(fleet), groups=2)
    assert held(core) == [] and metrics["reward/groups_failed"] == 2
    assert metrics["reward/samples_failed"] == 2 * N


def test_a_nan_score_fails_its_sample_alone_and_the_others_are_scored(make_fleet):
    """One response the reward model scores NaN, in a group of four: through the real client
    and servers that answer such a batch as SGLang does (500), only its sample fails."""
    tok = build_tokenizer()
    poison = tok.convert_tokens_to_ids("7")
    fleet = make_fleet(2, score_fn=lambda ids: math.nan if poison in ids else len(ids) / 10)
    client = fleet.client_factory(
        servers_from_urls(fleet.urls), api_key=None, batch_size=64, request_timeout_s=10.0,
        max_attempts=2, retry_backoff_s=0.0,
    )  # fmt: skip
    scorer = ModelScorer(client, RewardModelInputs(tok, apply_chat_template="on", max_length=512))

    async def score():
        try:
            return await scorer.score([{"role": "user", "content": "1+1="}], ["2", "3", "7", "22"])
        finally:
            await scorer.aclose()

    scores = asyncio.run(score())
    assert [s.failed for s in scores] == [False, False, True, False]
    assert "not finite" in str(scores[2].error)
    assert scores[3].raw > scores[0].raw  # the others are the model's own scores


class PassThroughClient:
    """A client that hands back whatever the server said (NaN, inf) without checking."""

    def __init__(self, replies):
        self.replies = replies
        self.servers = {}

    def set_servers(self, servers):
        self.servers = dict(servers)

    async def score(self, input_ids):
        await asyncio.sleep(0)
        return [self.replies[i % len(self.replies)] for i in range(len(input_ids))]

    def stats(self):
        return {}

    async def aclose(self):
        pass


def test_a_non_finite_model_score_fails_its_sample_and_the_learner_trains_nothing_on_it(tmp_path):
    inputs = RewardModelInputs(build_tokenizer(), apply_chat_template="on", max_length=512)
    model = ModelScorer(PassThroughClient([1.0, math.nan, 2.0, math.inf]), inputs)
    rewards = RewardPipeline(RewardRunner(5, 1), model, rule_weight=0.0)
    core, _, metrics = run(tmp_path, rewards, groups=2)
    trajs = held(core)
    assert len(trajs) == 2 * N
    failed = [t for t in trajs if t.reward_failed]
    assert len(failed) == 2 * 2 and all("not finite" in t.reward_error for t in failed)
    assert metrics["reward/samples_failed"] == 4 and metrics["reward/groups_failed"] == 0
    batch = learner_view(core, 2)
    assert batch.reward_valid.sum() == 2 * 2
    assert (batch.trained_lens[~batch.reward_valid] == 0).all()
    assert np.isfinite(batch.scores).all()


def test_a_custom_function_raising_on_one_sample_fails_only_that_sample(tmp_path):
    seen = Counter()

    def raises_on_the_third(data_source, solution_str, ground_truth, extra_info):
        seen["calls"] += 1
        if seen["calls"] == 3:
            raise RuntimeError("grader crashed")
        return 1.0

    rewards = RewardPipeline(RewardRunner(5, 1, raises_on_the_third))
    core, _, metrics = run(tmp_path, rewards, groups=2)
    trajs = held(core)
    assert len(trajs) == 2 * N
    assert [t.reward_error for t in trajs if t.reward_failed] == [
        "rule: raised RuntimeError('grader crashed')"
    ]
    assert metrics["reward/samples_failed"] == 1
    batch = learner_view(core, 2)
    assert batch.reward_valid.sum() == 2 * N - 1
