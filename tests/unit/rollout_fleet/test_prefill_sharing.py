"""Prefill sharing: a GRPO group's n samples, sent as n separate requests (as rollout
workers send them), run their prompt through the model once, in one step or across
steps, and generate exactly what they would have without sharing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_fleet.engine.kv_cache import PrefillCache
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.sampling import RowSampling
from rollout_fleet.engine.scheduler import Scheduler, Sequence
from weight_sync.sources import module_named_tensors

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17], [7, 7, 7, 7, 7, 7, 7]]
GROUP = 4  # samples per prompt
NEW_TOKENS = 12


def _group_requests(temperature: float, tag: str = "") -> list[Sequence]:
    """One sequence per sample, each its own request (its own rid), seeded per sample."""
    seqs = []
    for p, prompt in enumerate(PROMPTS):
        for j in range(GROUP):
            generator = torch.Generator().manual_seed(1000 * p + j)
            seqs.append(
                Sequence(
                    rid=f"{tag}p{p}s{j}",
                    parent_rid=f"{tag}p{p}s{j}",
                    prompt_ids=list(prompt),
                    max_new_tokens=NEW_TOKENS,
                    sampling=RowSampling(temperature=temperature, generator=generator),
                    stop_token_ids=frozenset(),
                    stop_strings=[],
                    on_event=lambda seq, done: None,
                )
            )
    return seqs


def _generate(scheduler: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    done = threading.Semaphore(0)
    for seq in seqs:
        seq.on_event = lambda s, finished: done.release() if finished else None
    scheduler.submit(seqs).result(10)
    for _ in seqs:
        assert done.acquire(timeout=60)
    return seqs


@pytest.fixture
def runner(tiny_model_dir):
    torch.set_num_threads(1)
    return ModelRunner(tiny_model_dir)


def _scheduler(runner: ModelRunner, share: bool) -> Scheduler:
    runner.kv.clear()
    scheduler = Scheduler(runner, max_running_requests=64, share_prefill=share)
    scheduler.start()
    return scheduler


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded-sampling"])
def test_shared_prefill_generates_the_same_tokens_and_logprobs(runner, temperature):
    outputs = {}
    for share in (False, True):
        scheduler = _scheduler(runner, share)
        try:
            seqs = _generate(scheduler, _group_requests(temperature))
        finally:
            scheduler.stop()
        outputs[share] = [(s.output_ids, s.logprobs) for s in seqs]
        if share:
            assert scheduler.stats["prefill_tokens"] == sum(len(p) for p in PROMPTS)
        else:
            assert scheduler.stats["prefill_tokens"] == GROUP * sum(len(p) for p in PROMPTS)
    for (ids_off, lps_off), (ids_on, lps_on) in zip(outputs[False], outputs[True], strict=True):
        assert ids_on == ids_off
        # Only the batch shape of the prefill forward differs: the same numbers to float32 noise.
        assert torch.allclose(torch.tensor(lps_on), torch.tensor(lps_off), atol=1e-5, rtol=0)
    if temperature > 0:  # the samples of a group still differ from each other
        assert len({tuple(ids) for ids, _ in outputs[True][:GROUP]}) > 1


def test_group_admitted_across_steps_is_prefilled_once(runner):
    scheduler = _scheduler(runner, share=True)
    try:
        seqs = _group_requests(0.0)
        first = [s for s in seqs if s.rid.endswith("s0")]
        rest = [s for s in seqs if not s.rid.endswith("s0")]
        _generate(scheduler, first)  # one sample per group, finished before the rest arrive
        prefill_tokens = scheduler.stats["prefill_tokens"]
        _generate(scheduler, rest)
        assert scheduler.stats["prefill_tokens"] == prefill_tokens == sum(len(p) for p in PROMPTS)
        assert scheduler.stats["prefill_cache_hits"] == len(rest)
        assert all(s.cached_tokens == len(s.prompt_ids) for s in rest)
        by_prompt = {}
        for seq in seqs:  # greedy: every sample of a group is the same
            by_prompt.setdefault(tuple(seq.prompt_ids), set()).add(tuple(seq.output_ids))
        assert all(len(outs) == 1 for outs in by_prompt.values())
    finally:
        scheduler.stop()


def test_an_idle_engine_gathers_a_burst_of_submissions_into_one_prefill(runner):
    runner.kv.clear()
    # A window far wider than the gap between the two submissions below.
    scheduler = Scheduler(runner, max_running_requests=64, admission_window_s=0.5)
    scheduler.start()
    try:
        seqs = [s for s in _group_requests(0.0) if len(s.prompt_ids) == 5]  # prompts 0 and 1
        done = threading.Semaphore(0)
        for seq in seqs:
            seq.on_event = lambda s, finished: done.release() if finished else None
        scheduler.submit(seqs[:GROUP]).result(10)
        time.sleep(0.05)
        scheduler.submit(seqs[GROUP:]).result(10)
        for _ in seqs:
            assert done.acquire(timeout=60)
        assert scheduler.stats["prefills"] == 1 and scheduler.stats["prefill_tokens"] == 10
    finally:
        scheduler.stop()


def test_sharing_switched_off_at_run_time_caches_nothing(runner):
    scheduler = _scheduler(runner, share=True)
    try:
        scheduler.share_prefill = False  # as the rollout bench's unshared arm does
        _generate(scheduler, _group_requests(0.0))
        assert len(scheduler.prefill_cache) == 0
        assert scheduler.stats["prefill_tokens"] == GROUP * sum(len(p) for p in PROMPTS)
    finally:
        scheduler.stop()


def test_new_weights_clear_the_shared_prefills(runner):
    scheduler = _scheduler(runner, share=True)
    try:
        _generate(scheduler, _group_requests(0.0, "a")[:1])
        assert len(scheduler.prefill_cache) == 1
        tensors = module_named_tensors(runner.model)
        scheduler.load_weights([(n, t * 1.5) for n, t in tensors], "v1").result(10)
        assert len(scheduler.prefill_cache) == 0
        before = scheduler.stats["prefill_tokens"]
        _generate(scheduler, _group_requests(0.0, "b")[:1])
        assert scheduler.stats["prefill_tokens"] == before + len(PROMPTS[0])
    finally:
        scheduler.stop()


def test_prefill_cache_keeps_the_most_recent_entries_within_its_bytes():
    def entry():
        return torch.zeros(1, 8), [torch.zeros(1, 2, 4, 4)], [torch.zeros(1, 2, 4, 4)]

    one_entry = (8 + 2 * 32) * 4
    cache = PrefillCache(max_bytes=2 * one_entry)
    cache.put((1,), *entry())
    cache.put((2,), *entry())
    assert cache.get((1,)) is not None  # (1,) is now the most recent
    cache.put((3,), *entry())
    assert cache.get((2,)) is None and cache.get((1,)) is not None and cache.get((3,)) is not None
    assert cache.nbytes() == 2 * one_entry
    disabled = PrefillCache(max_bytes=0)
    assert disabled.put((1,), *entry()) is not None and len(disabled) == 0
