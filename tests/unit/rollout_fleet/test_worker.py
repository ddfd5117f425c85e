"""RolloutWorker against in-process fake engines: counts, whole groups, admission, aborts, failover."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from buffer.wire import decode_trajectory
from rollout_fleet.config import RolloutConfig
from rollout_fleet.delivery import DeliveryLedger
from rollout_fleet.membership import EngineStatus as EngineState
from rollout_fleet.membership import Membership
from rollout_fleet.rewards.pipeline import RewardPipeline
from rollout_fleet.rewards.runner import RewardRunner
from rollout_fleet.router import Router
from rollout_fleet.worker import RolloutWorker
from tests.unit.rollout_fleet.fakes import (
    CollectingSender,
    FakeAdmission,
    FakeEngine,
    FakeTokenizer,
    fake_rewards,
    parity_reward,
    prompt,
)


def make_worker(
    engines,
    *,
    n=3,
    max_new_tokens=4,
    sender=None,
    admission=None,
    prompts=None,
    groups_per_version=1000,
    max_staleness=0,
    ledger=None,
    rewards=None,
    max_failed_reward_groups=0,
    **config,
):
    router = Router(Membership(suspect_cooldown_s=config.get("suspect_cooldown_s", 30.0)))
    for engine in engines:
        router.membership.launch(engine.name, engine.base_url)
        router.membership.weights_loaded(engine.name, 0)
    sender = sender or CollectingSender()
    cfg = RolloutConfig(
        n=n,
        max_new_tokens=max_new_tokens,
        retry_backoff_s=0.0,
        admission_poll_interval_s=0.01,
        **config,
    )
    admission = admission or FakeAdmission()
    # the rule's parameters come from the buffer's admission state, as in a run
    admission.max_staleness, admission.groups_per_version = max_staleness, groups_per_version
    admission.max_concurrent = cfg.max_concurrent_groups
    worker = RolloutWorker(
        cfg,
        engines={e.name: e for e in engines},
        router=router,
        reader=iter(prompts if prompts is not None else [prompt(i) for i in range(1000)]),
        sender=ledger if ledger is not None else sender,
        admission_source=admission,
        rewards=rewards if rewards is not None else fake_rewards(),
        tokenizer=FakeTokenizer(),
        ledger=ledger,
        max_failed_reward_groups=max_failed_reward_groups,
    )
    return worker, router, sender


class PayloadSink:
    """The ledger's socket: decoded into a CollectingSender."""

    def __init__(self, sender: CollectingSender) -> None:
        self.sender = sender

    def send_payload(self, payload: bytes, timeout_s: float | None = None) -> None:
        self.sender.send(decode_trajectory(payload))


class GroupCounts:
    """The buffer's ``group_status``: samples it holds per group id."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def group_status(self, group_ids: list[str]) -> list[int]:
        return [self.held.get(g, 0) for g in group_ids]


def make_ledger(sender: CollectingSender, prompts, n: int) -> tuple[DeliveryLedger, GroupCounts]:
    counts = GroupCounts()
    return DeliveryLedger(iter(prompts), PayloadSink(sender), counts, n), counts


def check_groups_whole(trajectories, n):
    by_group = Counter(t.group_id for t in trajectories)
    assert all(count == n for count in by_group.values()), by_group
    assert len({t.uid for t in trajectories}) == len(trajectories)
    for t in trajectories:
        assert t.group_size == n
        assert t.uid.startswith(t.group_id + "/")
    return by_group


async def wait_for(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def test_every_prompt_gives_n_trajectories_sent_whole_and_tagged():
    engines = [FakeEngine("a", version=3), FakeEngine("b", version=3)]
    worker, _, sender = make_worker(engines, n=3)
    asyncio.run(worker.run(num_groups=5))
    trajs = sender.trajectories
    assert len(trajs) == 15
    groups = check_groups_whole(trajs, 3)
    assert len(groups) == 5
    for t in trajs:
        assert t.response_ids.numpy().tolist() == [100, 101, 102, 103]
        assert t.token_versions.numpy().tolist() == [3, 3, 3, 3]
        assert t.finish_reason == "length"
        assert t.score == 1.0 and t.reward_metrics == {"len": 4.0, "rule_score": 1.0}
        assert set(t.timings) == {"generate_s", "reward_s", "reward_group_s"}
        assert t.reward_error == ""
        assert t.engine_id in ("a", "b")
    # a group's samples all went to one engine (prefix reuse)
    for gid in groups:
        assert len({t.engine_id for t in trajs if t.group_id == gid}) == 1
    assert threading.get_ident() not in sender.threads  # sent off the event loop
    metrics = worker.metrics()
    assert metrics["rollout/groups_finished"] == 5
    assert metrics["rollout/tokens_generated"] == 60
    assert metrics["rollout/groups_running"] == 0
    assert 0.0 <= metrics["rollout/idle_fraction"] <= 1.0


def test_sampling_params_come_from_config_with_eos_as_stop_token():
    engine = FakeEngine("a", eos_at=1)
    worker, _, sender = make_worker(
        [engine], n=1, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=6
    )
    asyncio.run(worker.run(num_groups=1))
    params = engine.calls[0]["params"]
    assert params == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_new_tokens": 6,
        "stop_token_ids": [2],
    }
    (traj,) = sender.trajectories
    assert traj.finish_reason == "stop"
    assert traj.temperature == pytest.approx(0.7)
    assert traj.response_ids.numpy().tolist() == [100, 101]


def test_admission_never_starts_more_groups_than_the_staleness_window_allows():
    async def scenario():
        engine = FakeEngine("a")
        sender = CollectingSender()
        admission = FakeAdmission(sender, group_size=2)
        # eta = 1, B = 2: at version 0 at most (1 + 0 + 1) * 2 = 4 groups ever
        worker, _, _ = make_worker(
            [engine], n=2, sender=sender, admission=admission, groups_per_version=2, max_staleness=1
        )
        task = asyncio.create_task(worker.run())
        await wait_for(lambda: len(sender.trajectories) == 8)
        polls = admission.polls
        await wait_for(lambda: admission.polls >= polls + 5)  # admission keeps asking...
        assert worker.groups_started == 4  # ...but nothing more may start
        admission.policy_version = 1  # the learner consumed a version: 2 more groups
        await wait_for(lambda: len(sender.trajectories) == 12)
        polls = admission.polls
        await wait_for(lambda: admission.polls >= polls + 5)
        assert worker.groups_started == 6
        await worker.stop()
        await task

    asyncio.run(scenario())


def test_a_published_version_starts_the_next_groups_at_once_not_at_the_next_poll():
    async def scenario():
        sender = CollectingSender()
        admission = FakeAdmission(sender, group_size=1)
        # eta = 0, B = 1: one group per version; a poll interval far longer than the test
        worker, _, _ = make_worker(
            [FakeEngine("a")], n=1, sender=sender, admission=admission, groups_per_version=1
        )
        worker.config.admission_poll_interval_s = 60.0
        task = asyncio.create_task(worker.run())
        await wait_for(lambda: len(sender.trajectories) == 1)
        await asyncio.sleep(0.2)  # it asked again, was refused, and sleeps for 60 s
        assert worker.groups_started == 1 and admission.polls >= 2
        admission.policy_version = 1  # the learner published version 1
        worker.admission_changed()
        await wait_for(lambda: worker.groups_started == 2, timeout=5.0)
        await worker.stop()
        await task

    asyncio.run(scenario())


def test_a_sent_group_counts_as_running_until_the_buffer_holds_it():
    async def scenario():
        engine = FakeEngine("a")
        sender = CollectingSender()
        admission = FakeAdmission()  # the buffer has accepted nothing yet (groups in transit)
        ledger, buffer_holds = make_ledger(sender, [], n=2)
        # eta = 0, B = 2: two groups, and no more while they are in neither count
        worker, _, _ = make_worker(
            [engine], n=2, ledger=ledger, admission=admission, groups_per_version=2
        )
        task = asyncio.create_task(worker.run())
        await wait_for(lambda: len(sender.trajectories) == 4)
        polls = admission.polls
        await wait_for(lambda: admission.polls >= polls + 5)
        assert worker.groups_started == 2 and worker.running_groups == 2
        assert ledger.sent_unconfirmed() == 2  # the one record of sent, not acknowledged
        # the buffer now holds both groups and counts them accepted at version 1
        for traj in sender.trajectories:
            buffer_holds.held[traj.group_id] = buffer_holds.held.get(traj.group_id, 0) + 1
        admission.sender, admission.group_size, admission.policy_version = sender, 2, 1
        await wait_for(lambda: worker.groups_started == 4)
        assert ledger.confirmed_groups >= 2
        await worker.stop()
        await task

    asyncio.run(scenario())


def test_concurrency_cap_bounds_groups_in_flight():
    async def scenario():
        engine = FakeEngine("a")
        engine.hold = True
        worker, _, sender = make_worker([engine], n=2, max_concurrent_groups=3)
        task = asyncio.create_task(worker.run(num_groups=7))
        await wait_for(lambda: worker.running_groups == 3 and engine.inflight == 6)
        assert worker.groups_started == 3
        engine.release()
        await task
        assert len(sender.trajectories) == 14
        assert engine.max_inflight_groups <= 3

    asyncio.run(scenario())


def test_abort_mode_partials_are_resubmitted_and_versions_kept_per_piece():
    engine = FakeEngine("a", version=0)
    engine.abort_first_after = 2
    worker, _, sender = make_worker([engine], n=2, max_new_tokens=5)
    asyncio.run(worker.run(num_groups=3))
    trajs = sender.trajectories
    assert len(trajs) == 6
    check_groups_whole(trajs, 2)
    for t in trajs:
        assert t.response_ids.numpy().tolist() == [100, 101, 102, 103, 104]
        versions = t.token_versions.numpy().tolist()
        assert versions[:2] == [versions[0]] * 2
        assert all(v > versions[0] for v in versions[2:])  # after the update: a newer version
        assert len(t.behavior_logprobs) == 5
    resubmits = [c for c in engine.calls if c["params"]["max_new_tokens"] == 3]
    assert len(resubmits) == 6
    for call in resubmits:
        assert call["input_ids"][-2:] == [100, 101]  # prompt + the partial prefix
    assert worker.metrics()["rollout/abort_resubmits"] == 6


def test_failing_engine_is_marked_suspect_and_its_samples_regenerate_elsewhere():
    bad, good = FakeEngine("a"), FakeEngine("b")
    bad.fail = True
    worker, router, sender = make_worker([bad, good], n=3)
    asyncio.run(worker.run(num_groups=4))
    trajs = sender.trajectories
    assert len(trajs) == 12
    check_groups_whole(trajs, 3)
    assert {t.engine_id for t in trajs} == {"b"}
    assert router.state("a") is EngineState.SUSPECT
    assert worker.metrics()["rollout/engine_errors"] >= 1


def test_engine_declared_dead_mid_request_loses_nothing_and_duplicates_nothing():
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        a.hold = True
        b.hold = True
        worker, router, sender = make_worker([a, b], n=2)
        task = asyncio.create_task(worker.run(num_groups=4))
        await wait_for(lambda: a.inflight == 4 and b.inflight == 4)
        router.membership.die("a", "test")  # as the fleet would on a failed health check
        b.release()
        await task
        trajs = sender.trajectories
        assert len(trajs) == 8
        check_groups_whole(trajs, 2)
        assert {t.engine_id for t in trajs} == {"b"}
        assert worker.metrics()["rollout/requests_lost_to_dead_engines"] == 4

    asyncio.run(scenario())


def test_engine_that_must_reload_weights_mid_request_loses_and_duplicates_nothing():
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        a.hold = True
        b.hold = True
        worker, router, sender = make_worker([a, b], n=2)
        task = asyncio.create_task(worker.run(num_groups=4))
        await wait_for(lambda: a.inflight == 4 and b.inflight == 4)
        # as a publish that dropped it would: it holds stale weights until the next one
        router.membership.require_weights("a", 1, "missed version 1")
        b.release()
        await task
        trajs = sender.trajectories
        assert len(trajs) == 8
        check_groups_whole(trajs, 2)
        assert {t.engine_id for t in trajs} == {"b"}
        assert worker.metrics()["rollout/requests_lost_to_dead_engines"] == 4

    asyncio.run(scenario())


def test_a_failed_request_on_an_engine_replaced_meanwhile_does_not_touch_the_new_one():
    async def scenario():
        a = FakeEngine("a")
        a.hold = True
        worker, router, _ = make_worker([a], n=1)
        task = asyncio.create_task(worker.run(num_groups=1))
        await wait_for(lambda: a.inflight == 1)
        lease = router.acquire("probe")
        router.release(lease)
        router.membership.die("a", "killed")
        router.membership.launch("a", "http://a/2")
        router.membership.weights_loaded("a", 0)
        worker.runner._suspect(lease, "late failure of the old process")
        assert router.state("a") is EngineState.READY  # not suspect: another process
        worker.runner._suspect(router.acquire("probe"), "a failure of the new process")
        assert router.state("a") is EngineState.SUSPECT
        router.membership.clear_suspect("a")
        a.release()
        await task

    asyncio.run(scenario())


def test_sample_out_of_attempts_drops_its_group_whole_and_counts_it():
    bad = FakeEngine("a")
    bad.fail = True
    sender = CollectingSender()
    ledger, _ = make_ledger(sender, [prompt(i) for i in range(2)], n=2)
    worker, _, _ = make_worker(
        [bad], n=2, max_sample_attempts=2, suspect_cooldown_s=0.0, ledger=ledger,
        prompts=ledger.prompts(),
    )  # fmt: skip
    asyncio.run(worker.run(num_groups=2))
    assert sender.trajectories == []
    assert worker.metrics()["rollout/groups_failed"] == 2
    # the delivery ledger is told, so it neither waits for them nor regenerates them
    assert ledger.unfinished_prompts() == []


def test_admission_errors_are_counted_and_retried():
    sender = CollectingSender()
    admission = FakeAdmission()
    admission.fail_next = 3
    worker, _, _ = make_worker([FakeEngine("a")], n=1, sender=sender, admission=admission)
    asyncio.run(worker.run(num_groups=2))
    assert len(sender.trajectories) == 2
    assert worker.metrics()["rollout/admission_errors"] == 3


def test_stop_with_deadline_aborts_groups_in_flight_and_sends_nothing_partial():
    async def scenario():
        engine = FakeEngine("a")
        engine.hold = True
        worker, _, sender = make_worker([engine], n=2)
        task = asyncio.create_task(worker.run())
        await wait_for(lambda: engine.inflight >= 2)
        await worker.stop(deadline_s=0.05)
        await task
        assert sender.trajectories == []
        assert worker.groups_cancelled >= 1
        assert len(engine.aborted_rids) >= 2
        assert worker.running_groups == 0

    asyncio.run(scenario())


def test_graceful_stop_lets_groups_in_flight_finish():
    async def scenario():
        engine = FakeEngine("a")
        engine.hold = True
        worker, _, sender = make_worker([engine], n=2, max_concurrent_groups=2)
        task = asyncio.create_task(worker.run())
        await wait_for(lambda: engine.inflight == 4)
        stopping = asyncio.create_task(worker.stop(deadline_s=30))
        await asyncio.sleep(0.02)
        engine.release()
        await stopping
        await task
        assert len(sender.trajectories) == 4
        assert worker.groups_started == 2
        check_groups_whole(sender.trajectories, 2)

    asyncio.run(scenario())


def test_validate_scores_one_greedy_sample_per_prompt_by_data_source():
    engine = FakeEngine("a")
    prompts = [prompt(0, "src/a"), prompt(1, "src/a"), prompt(2, "src/b")]
    worker, _, sender = make_worker([engine], n=4, max_new_tokens=4)

    async def twice():
        return [await worker.validate(prompts, keep_samples=2, sample_seed=5) for _ in range(2)]

    validation, again = asyncio.run(twice())
    result = validation.metrics
    assert result["val/num_samples"] == 3
    assert result["val/score/mean"] == 1.0
    # verl's names: val-core/<data_source>/reward/mean@1
    assert result["val-core/src/a/reward/mean@1"] == result["val-core/src/b/reward/mean@1"] == 1.0
    assert len(validation.samples) == 2 and validation.samples[0].score == 1.0
    assert [s.index for s in again.samples] == [s.index for s in validation.samples]
    assert len(engine.calls) == 6
    assert all(c["params"]["temperature"] == 0.0 for c in engine.calls)
    assert sender.trajectories == []


def test_a_crashing_group_stops_the_worker_loudly():
    class Broken(RewardPipeline):
        async def score_group(self, *args, **kwargs):
            raise KeyError("reward bug")

    worker, _, _ = make_worker([FakeEngine("a")], n=1)
    worker._rewards = Broken(RewardRunner(5, 1, parity_reward))
    with pytest.raises(RuntimeError, match="rollout group crashed"):
        asyncio.run(worker.run(num_groups=3))


def test_an_exhausted_reader_ends_the_run_after_its_groups_finish():
    worker, _, sender = make_worker([FakeEngine("a")], n=2, prompts=[prompt(0), prompt(1)])
    asyncio.run(worker.run())
    assert len(sender.trajectories) == 4
    check_groups_whole(sender.trajectories, 2)
