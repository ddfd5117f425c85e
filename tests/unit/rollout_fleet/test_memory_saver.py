"""The embedded engine's memory release by SGLang's tags: what is freed, how it comes back.

Measured on this process (the engine's runner lives here): releasing ``weights`` lowers
the RSS by about the weights' bytes; resuming gives storages of the same size back,
holding garbage until a push fills them; the fused decoder's views stay views.
"""

from __future__ import annotations

import pytest
import torch

from fleetrl.models.tiny import make_tiny_model
from rollout_fleet.engine.memory_saver import (
    MEMORY_TAGS,
    EngineMemory,
    MemoryOccupationError,
    parse_tags,
)
from rollout_fleet.engine.runner import ModelRunner, WeightLoadError
from rollout_fleet.engine.scheduler import Scheduler


def _rss_kb() -> int:
    from learner.memory import rss_kb

    return rss_kb()


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """Wide enough (about 16 MiB of fp32 weights) for the RSS to show a release."""
    return make_tiny_model(
        tmp_path_factory.mktemp("wide") / "model", layers=2, hidden=384, heads=4, seed=0
    )


def _engine(model_dir, enabled: bool = True):
    runner = ModelRunner(model_dir)
    scheduler = Scheduler(runner, max_running_requests=2)
    return runner, scheduler, EngineMemory(runner, scheduler, enabled=enabled)


def test_no_tags_means_every_tag_and_unknown_tags_are_refused():
    assert parse_tags(None) == list(MEMORY_TAGS) == parse_tags([])
    assert parse_tags(["weights"]) == ["weights"]
    with pytest.raises(MemoryOccupationError, match=r"unknown memory tags \['kvcache'\]"):
        parse_tags(["kvcache"])


def test_releasing_the_weights_returns_their_bytes_to_the_system(wide_model_dir):
    runner, scheduler, memory = _engine(wide_model_dir)
    weights = memory.weight_bytes()
    assert weights > 12 * 2**20
    before = _rss_kb()
    freed = memory.release(["weights"])
    dropped = (before - _rss_kb()) * 1024
    assert freed == weights and memory.weight_bytes() == 0
    assert dropped >= 0.8 * weights, (dropped, weights)
    assert scheduler.memory_released and not scheduler._has_work()
    memory.resume(["weights"])
    assert memory.weight_bytes() == weights and not scheduler.memory_released
    runner.fused.check_fused()  # the fused projections are still views of the parameters


def test_released_weights_refuse_a_load_and_take_one_after_resume(tiny_model_dir):
    runner, _, memory = _engine(tiny_model_dir)
    named = [(n, p.detach().clone() + 1.0) for n, p in runner.model.named_parameters()]
    memory.release(None)
    with pytest.raises(WeightLoadError, match="is released"):
        runner.load_weights(named)
    assert runner.weight_rows(named[0][0], 1) is None  # nothing to read either
    memory.resume(["weights"])
    runner.load_weights(named)  # the push fills the resumed (uninitialised) memory
    for name, tensor in named:
        assert torch.equal(runner.named_weights()[name], tensor)


def test_resume_refuses_a_tag_that_was_not_released_and_changes_nothing(tiny_model_dir):
    _, _, memory = _engine(tiny_model_dir)
    memory.release(["kv_cache"])
    with pytest.raises(MemoryOccupationError, match=r"\['weights'\] were not released"):
        memory.resume(["kv_cache", "weights"])
    assert memory.released == {"kv_cache"}  # checked before anything resumed
    memory.resume(["kv_cache"])
    assert memory.released == set()


def test_release_of_kv_cache_flushes_the_prefix_cache(tiny_model_dir):
    runner, scheduler, memory = _engine(tiny_model_dir)
    logits = torch.zeros(1, runner.vocab_size)
    kv = [torch.zeros(1, 4, 3, 16) for _ in range(2)]
    scheduler.prefill_cache.put((1, 2, 3), logits, kv, kv)
    assert memory.kv_bytes() > 0
    freed = memory.release(["kv_cache"])
    assert freed > 0 and len(scheduler.prefill_cache) == 0 and memory.kv_bytes() == 0


def test_without_the_memory_saver_release_frees_nothing(tiny_model_dir):
    """SGLang without --enable-memory-saver: the calls succeed, the weights stay."""
    runner, scheduler, memory = _engine(tiny_model_dir, enabled=False)
    weights = memory.weight_bytes()
    assert memory.release(None) == 0
    assert memory.weight_bytes() == weights and memory.released == set(MEMORY_TAGS)
    memory.resume(None)
    assert not scheduler.memory_released


def test_a_busy_engine_refuses_release_and_a_paused_queue_does_not_count(tiny_model_dir):
    from rollout_fleet.engine.sampling import RowSampling
    from rollout_fleet.engine.scheduler import Sequence

    _, scheduler, memory = _engine(tiny_model_dir)
    waiting = Sequence(
        rid="r", parent_rid="r", prompt_ids=[1, 2], max_new_tokens=2,
        sampling=RowSampling(temperature=1.0), stop_token_ids=frozenset(), stop_strings=[],
        on_event=lambda seq, done: None,
    )  # fmt: skip
    scheduler.waiting.append(waiting)
    with pytest.raises(MemoryOccupationError, match="only when server is idle"):
        memory.release(None)
    scheduler.paused_mode = "abort"  # waiting requests are ignored while paused
    memory.release(None)
    assert memory.released == set(MEMORY_TAGS)
