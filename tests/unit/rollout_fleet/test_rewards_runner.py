"""RewardRunner never raises: raising, hanging, non-finite and malformed rewards fail their
sample (``error`` set, a 0.0 placeholder score) and are counted; the event loop stays free
while a reward hangs."""

from __future__ import annotations

import asyncio
import math
import threading

import numpy as np
import pytest

from rollout_fleet.rewards import RewardRegistry, RewardRunner
from rollout_fleet.rewards.runner import to_result


def _run(coro):
    return asyncio.run(coro)


def test_builtin_scores_come_back_with_metrics():
    runner = RewardRunner(timeout_s=5, max_workers=2)
    result = _run(runner.score("openai/gsm8k", "#### 7", "7", {"index": 0}))
    assert result.score == 1.0 and result.error is None
    assert result.metrics == {"acc": 1.0, "answer_found": 1.0}
    assert (runner.num_scored, runner.num_errors, runner.num_timeouts) == (1, 0, 0)


def test_custom_fn_overrides_the_registry_for_every_source():
    seen = []

    def custom(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, extra_info))
        return np.float32(0.25)

    runner = RewardRunner(timeout_s=5, max_workers=1, custom=custom)
    assert _run(runner.score("anything/at/all", "x", "y", {"k": 1})).score == 0.25
    assert seen == [("anything/at/all", {"k": 1})]


def _registry(fn) -> RewardRegistry:
    registry = RewardRegistry()
    registry.register("t", fn)
    return registry


def _raises(**kwargs):
    raise ZeroDivisionError("boom")


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (_raises, "raised ZeroDivisionError('boom')"),
        (lambda **kw: math.nan, "reward is not finite: nan"),
        (lambda **kw: {"score": math.inf}, "reward is not finite: inf"),
        (lambda **kw: {"acc": 1.0}, "reward dict has no 'score' key"),
        (lambda **kw: "1.0", "not a number"),
        (lambda **kw: None, "not a number"),
    ],
)
def test_a_failing_reward_fails_its_sample_and_is_counted_and_logged(fn, error, caplog):
    runner = RewardRunner(timeout_s=5, max_workers=1, registry=_registry(fn))
    result = _run(runner.score("t", "x", "y"))
    assert result.score == 0.0 and error in result.error
    assert (runner.num_errors, runner.num_timeouts) == (1, 0)
    assert result.failed
    assert "reward for data_source 't' failed (1 samples)" in caplog.text


def test_an_unknown_source_fails_and_check_sources_raises_up_front():
    runner = RewardRunner(timeout_s=5, max_workers=1)
    result = _run(runner.score("nope", "x", "y"))
    assert result.score == 0.0 and "no reward function for data_source 'nope'" in result.error
    assert runner.num_errors == 1
    with pytest.raises(ValueError, match="nope"):
        runner.check_sources(["synth/add", "nope"])
    runner.check_sources(["synth/add", "openai/gsm8k"])


def test_hanging_reward_times_out_without_blocking_the_loop_or_later_calls():
    release = threading.Event()

    def hangs(**kwargs):
        release.wait(60)
        return 1.0

    registry = _registry(hangs)
    registry.register("ok", lambda **kw: 1.0)
    runner = RewardRunner(timeout_s=0.2, max_workers=1, registry=registry)

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick_task = asyncio.create_task(ticker())
        hung = await runner.score("t", "x", "y")
        ticks_during_hang = ticks
        # The only worker slot was freed by the timeout: this call is not stuck behind the hang.
        after = await runner.score("ok", "x", "y")
        tick_task.cancel()
        return hung, ticks_during_hang, after

    try:
        hung, ticks_during_hang, after = _run(scenario())
        assert hung.score == 0.0 and "timed out after 0.2 s" in hung.error
        assert ticks_during_hang > 1  # the loop kept running while the reward hung
        assert after.score == 1.0 and after.error is None
        assert (runner.num_timeouts, runner.num_errors) == (1, 0)
        assert runner.num_hung == 1
    finally:
        release.set()


def test_to_result_keeps_only_finite_numeric_metrics():
    result = to_result({"score": True, "acc": 1, "pred": "7", "bad": math.nan}, 0.5)
    assert (result.score, result.metrics, result.elapsed_s) == (1.0, {"acc": 1.0}, 0.5)


def test_invalid_runner_settings_are_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardRunner(timeout_s=0, max_workers=1)
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        RewardRunner(timeout_s=1, max_workers=0)
