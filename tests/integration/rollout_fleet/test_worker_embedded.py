"""RolloutWorker against real embedded engines over HTTP (tiny model, loopback).

Proves on the real stack (EngineClient -> EmbeddedEngine -> scheduler): exact
trajectory counts with whole groups; an in-place weight update landing
mid-sequence tags tokens before and after with the right versions; abort-mode
pauses make the worker resubmit partials and still deliver prompts x n; a
stopped engine's groups are regenerated on the other engine with no loss and
no duplicates.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import numpy as np

from buffer.wire import AdmissionState
from fleetrl.data.reader import PromptItem
from rollout_fleet.client import EngineClient
from rollout_fleet.config import RolloutConfig
from rollout_fleet.rewards.pipeline import RewardPipeline
from rollout_fleet.rewards.runner import RewardRunner
from rollout_fleet.router import Router
from rollout_fleet.worker import RolloutWorker

MAX_NEW_TOKENS = 8


def parity_reward(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)


class Sink:
    def __init__(self):
        self.trajectories = []
        self._lock = threading.Lock()

    def send(self, traj):
        with self._lock:
            self.trajectories.append(traj)


def prompts(tokenizer, count):
    items = []
    for i in range(count):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{i}+{i}="}], add_generation_prompt=True, tokenize=False
        )
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
        items.append(PromptItem(i, ids, "synth/parity", "0", {}, []))
    return items


def make_worker(
    engines,
    tokenizer,
    *,
    n,
    count=0,
    items=None,
    max_new_tokens=MAX_NEW_TOKENS,
    stop_token_ids=None,
    rewards=None,
    worker_options=None,
    **config,
):
    """A worker on ``engines`` over ``items`` (default: ``count`` addition prompts);
    ``worker_options`` go to ``RolloutWorker`` itself, the rest to its ``RolloutConfig``."""
    router = Router()
    for engine in engines:
        router.membership.launch(engine.engine_id, engine.base_url)
        router.membership.weights_loaded(engine.engine_id, 0)
    sink = Sink()
    cfg = RolloutConfig(
        n=n,
        max_new_tokens=max_new_tokens,
        retry_backoff_s=0.05,
        admission_poll_interval_s=0.02,
        request_timeout_s=60,
        **config,
    )
    worker = RolloutWorker(
        cfg,
        engines={e.engine_id: EngineClient(e.base_url, timeout_s=60) for e in engines},
        router=router,
        reader=iter(items if items is not None else prompts(tokenizer, count)),
        sender=sink,
        admission_source=lambda: AdmissionState(  # as the buffer reports it: nothing accepted
            policy_version=0,
            accepted_groups=0,
            max_staleness=0,
            groups_per_version=1000,
            max_concurrent=cfg.max_concurrent_groups,
        ),
        rewards=rewards
        or RewardPipeline(RewardRunner(timeout_s=5, max_workers=2, custom=parity_reward)),
        tokenizer=tokenizer,
        stop_token_ids=stop_token_ids,
        **(worker_options or {}),
    )
    return worker, router, sink


def run_then_close(worker, coro):
    """Run ``coro`` on a fresh loop, then close the worker's HTTP sessions on that loop."""

    async def main():
        try:
            return await coro
        finally:
            await worker.aclose()

    return asyncio.run(main())


def check_exact(trajectories, groups, n):
    assert len(trajectories) == groups * n
    per_group = Counter(t.group_id for t in trajectories)
    assert len(per_group) == groups and set(per_group.values()) == {n}
    assert len({t.uid for t in trajectories}) == len(trajectories)
    for t in trajectories:
        t.validate()
        assert 1 <= len(t.response_ids) <= MAX_NEW_TOKENS
        assert np.all(np.isfinite(t.behavior_logprobs.numpy()))
        assert np.all(t.behavior_logprobs.numpy() <= 0)


class MidwayAction:
    """Run ``action(scheduler)`` once, on ``engine``'s scheduler thread right after a step
    that left some sequence with part (not all) of its tokens generated.

    Armed on creation, before any request is sent, and checked after every step, so no
    midway moment can slip past (a poll from another thread could miss them all when a
    batch finishes in a few milliseconds)."""

    def __init__(self, engine, action):
        self.done = threading.Event()
        scheduler = engine.scheduler
        step = scheduler._step

        def step_then_check():
            step()
            if self.done.is_set():
                return
            live = [s for s in scheduler.running if not s.finished]
            if any(0 < len(s.output_ids) < s.max_new_tokens for s in live):
                action(scheduler)
                self.done.set()

        scheduler._step = step_then_check

    def wait(self, timeout_s=60.0):
        if not self.done.wait(timeout_s):
            raise AssertionError("no sequence was ever seen mid-generation")


def abort_and_update(scheduler):
    """An abort-mode weight update to version 1, as the scheduler runs one."""
    scheduler._pause("abort")  # running requests return partial output, finish_reason abort
    scheduler._set_version("1")
    scheduler._resume()


def run_with_midway_action(worker, engine, num_groups, action):
    """Run ``num_groups`` groups; ``action`` hits ``engine`` while a sequence is midway."""

    async def scenario():
        midway = MidwayAction(engine, action)
        task = asyncio.create_task(worker.run(num_groups=num_groups))
        await asyncio.to_thread(midway.wait)
        await task

    run_then_close(worker, scenario())


def test_worker_on_two_embedded_engines_sends_prompts_times_n_whole(engines, tokenizer):
    started = engines(2)
    worker, _, sink = make_worker(started, tokenizer, n=3, count=6)
    run_then_close(worker, worker.run(num_groups=6))
    check_exact(sink.trajectories, 6, 3)
    for t in sink.trajectories:
        assert set(t.token_versions.numpy().tolist()) == {0}
        assert (
            t.prompt_ids.numpy().tolist()
            == prompts(tokenizer, 6)[t.prompt_index].prompt_ids.tolist()
        )
    assert {t.engine_id for t in sink.trajectories} == {"e0", "e1"}
    assert worker.metrics()["rollout/tokens_generated"] == sum(
        len(t.response_ids) for t in sink.trajectories
    )


def test_in_place_update_mid_sequence_tags_tokens_before_and_after(engines, tokenizer):
    (engine,) = engines(1)
    worker, _, sink = make_worker([engine], tokenizer, n=4, count=4, max_concurrent_groups=4)

    def update(scheduler):
        scheduler._pause("in_place")  # what POST /pause_generation {"mode": "in_place"} does
        scheduler._set_version("1")  # ... then the weight load of version 1
        scheduler._resume()

    run_with_midway_action(worker, engine, 4, update)
    check_exact(sink.trajectories, 4, 4)
    mixed = 0
    for t in sink.trajectories:
        versions = t.token_versions.numpy().tolist()
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        mixed += versions[0] == 0 and versions[-1] == 1
    assert mixed >= 1  # at least one sequence straddles the update
    assert worker.metrics()["rollout/abort_resubmits"] == 0


def test_abort_mode_pause_resubmits_partials_and_keeps_counts_exact(engines, tokenizer):
    (engine,) = engines(1)
    worker, _, sink = make_worker([engine], tokenizer, n=4, count=4, max_concurrent_groups=4)

    run_with_midway_action(worker, engine, 4, abort_and_update)
    check_exact(sink.trajectories, 4, 4)
    assert worker.metrics()["rollout/abort_resubmits"] >= 1
    straddling = [t for t in sink.trajectories if set(t.token_versions.numpy().tolist()) == {0, 1}]
    assert straddling  # a partial from version 0 completed on version 1
    for t in sink.trajectories:
        versions = t.token_versions.numpy().tolist()
        assert versions == sorted(versions)
        assert t.finish_reason in ("stop", "length")


def test_dead_engine_groups_regenerate_on_the_other_without_loss_or_duplicates(engines, tokenizer):
    first, second = engines(2)
    worker, router, sink = make_worker([first, second], tokenizer, n=2, count=8)

    def crash(scheduler):
        scheduler._stop = True  # the scheduler thread exits after this command: engine dead

    async def scenario():
        midway = MidwayAction(first, crash)
        task = asyncio.create_task(worker.run(num_groups=8))
        await asyncio.to_thread(midway.wait)
        async with EngineClient(first.base_url, timeout_s=5) as probe:
            while await probe.health():  # the fleet's health check: 503 once the engine died
                await asyncio.sleep(0.01)
        router.membership.die("e0", "health check failed")  # ... and its verdict
        await task

    run_then_close(worker, scenario())
    check_exact(sink.trajectories, 8, 2)
    metrics = worker.metrics()
    moved = metrics["rollout/requests_lost_to_dead_engines"] + metrics["rollout/abort_resubmits"]
    assert moved >= 1
    # every group that was not finished on e0 before the crash was completed by e1
    assert all(t.engine_id in ("e0", "e1", "e0+e1") for t in sink.trajectories)
    assert any("e1" in t.engine_id for t in sink.trajectories)


def test_validate_runs_greedy_through_the_fleet(engines, tokenizer):
    started = engines(2)
    worker, _, sink = make_worker(started, tokenizer, n=4, count=0)

    async def twice():
        return [await worker.validate(prompts(tokenizer, 5)) for _ in range(2)]

    first, second = run_then_close(worker, twice())
    result, again = first.metrics, second.metrics
    assert result["val/num_samples"] == 5 and result["val/num_failed"] == 0
    assert 0.0 <= result["val/score/mean"] <= 1.0
    assert "val-core/synth/parity/reward/mean@1" in result
    assert again["val/score/mean"] == result["val/score/mean"]  # greedy is deterministic
    assert sink.trajectories == []
