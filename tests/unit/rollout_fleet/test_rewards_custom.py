"""Your own reward function, from a file outside the package: the three kinds verl users
write (single, batched, async), ``reward_kwargs``, the data sources it claims, judge access
keywords, and what fails: only the sample (or, for one batched call, the group's samples
it scored), counted; a file or signature that cannot work is refused at load."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from rollout_fleet.rewards import RewardLoadError, load_custom_reward
from rollout_fleet.rewards.judge import JudgeAccess
from rollout_fleet.rewards.runner import RewardRunner

SINGLE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if "boom" in solution_str:
        raise ValueError("cannot grade " + solution_str)
    if "nan" in solution_str:
        return float("nan")
    return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str)}
"""

BATCHED = """
CALLS = []

def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    CALLS.append(len(solution_strs))
    if any("boom" in s for s in solution_strs):
        raise RuntimeError("batch grader down")
    if any("short" in s for s in solution_strs):
        return [1.0]
    return [
        float("inf") if s == "inf" else {"score": scale * float(s == g), "batch": len(solution_strs)}
        for s, g in zip(solution_strs, ground_truths)
    ]
"""

ASYNC = """
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address=None):
    await asyncio.sleep(0.3 if solution_str == "slow" else 0)
    return {"score": float(solution_str == ground_truth), "router": float(reward_router_address is not None)}
"""

JUDGE = """
SEEN = []

def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):
    SEEN.append(sorted(kwargs))
    return 1.0

def verl_judge(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer):
    SEEN.append((reward_router_address, reward_model_tokenizer))
    return 0.5

def engines_judge(data_source, solution_str, ground_truth, extra_info, engine_urls, engine_api_key):
    SEEN.append((engine_urls, engine_api_key))
    return 0.25
"""


def write(tmp_path: Path, source: str, name: str = "my_reward.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def run(coro):
    return asyncio.run(coro)


def test_a_single_function_scores_each_sample_with_its_reward_kwargs(tmp_path):
    custom = load_custom_reward(write(tmp_path, SINGLE), reward_kwargs={"bonus": 0.5})
    assert not custom.batched and not custom.is_async
    runner = RewardRunner(5, 2, custom)
    result = run(runner.score("any/source", "7", "7", {"index": 0}))
    assert (result.score, result.metrics, result.error) == (1.5, {"length": 1.0}, None)


def test_a_function_that_raises_or_returns_nan_fails_only_its_sample(tmp_path):
    runner = RewardRunner(5, 2, load_custom_reward(write(tmp_path, SINGLE)))
    results = run(runner.score_batch(["s"] * 3, ["7", "boom", "nan"], ["7"] * 3, [None] * 3))
    assert [r.failed for r in results] == [False, True, True]
    assert results[0].score == 1.0
    assert "raised ValueError('cannot grade boom')" in results[1].error
    assert "not finite" in results[2].error
    assert (runner.num_scored, runner.num_errors) == (3, 2)


def test_a_batched_function_scores_a_group_in_one_call(tmp_path):
    path = write(tmp_path, BATCHED)
    custom = load_custom_reward(path, reward_kwargs={"scale": 2.0})
    assert custom.batched
    runner = RewardRunner(5, 2, custom)
    results = run(runner.score_batch(["s"] * 3, ["1", "2", "inf"], ["1", "1", "1"], [{}] * 3))
    assert [r.score for r in results[:2]] == [2.0, 0.0]
    assert results[0].metrics == {"batch": 3.0}
    assert results[2].failed and "not finite" in results[2].error  # only that item fails
    assert custom.fn.__globals__["CALLS"] == [3]  # one call for the three samples


def test_a_batched_call_that_raises_or_miscounts_fails_the_samples_it_was_given(tmp_path):
    runner = RewardRunner(5, 2, load_custom_reward(write(tmp_path, BATCHED, "batch2.py")))
    raised = run(runner.score_batch(["s"] * 2, ["boom", "1"], ["1", "1"], [{}] * 2))
    assert all(r.failed and "batch grader down" in r.error for r in raised)
    short = run(runner.score_batch(["s"] * 2, ["short", "1"], ["1", "1"], [{}] * 2))
    assert all(r.failed and "1 scores for 2 samples" in r.error for r in short)
    assert runner.num_errors == 4
    # a batched function scores a lone sample (validation) as a batch of one
    one = run(runner.score("s", "1", "1", {}))
    assert one.score == 1.0


def test_an_async_function_is_awaited_with_the_timeout_and_gets_the_router_address(tmp_path):
    custom = load_custom_reward(write(tmp_path, ASYNC))
    assert custom.is_async and custom.judge_keywords == {"reward_router_address"}
    judge = JudgeAccess(reward_servers=lambda: {"reward-0": "http://10.1.2.3:30010"})
    runner = RewardRunner(0.1, 1, custom, judge=judge)
    results = run(runner.score_batch(["s"] * 3, ["7", "slow", "8"], ["7"] * 3, [None] * 3))
    assert results[0].score == 1.0 and results[0].metrics == {"router": 1.0}
    assert results[1].failed and "timed out after 0.1 s" in results[1].error
    assert results[2].score == 0.0 and not results[2].failed
    assert runner.num_timeouts == 1 and runner.num_hung == 0  # a coroutine is cancelled


def test_a_hanging_sync_function_times_out_and_the_others_still_score(tmp_path):
    path = write(tmp_path, "import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n    time.sleep(5 if solution_str == 'hang' else 0)\n    return 1.0\n")  # fmt: skip
    runner = RewardRunner(0.2, 2, load_custom_reward(path))
    results = run(runner.score_batch(["s"] * 2, ["hang", "ok"], ["x", "x"], [None] * 2))
    assert results[0].failed and "timed out" in results[0].error
    assert results[1].score == 1.0


def test_the_function_scores_the_sources_it_claims_and_builtins_keep_the_rest(tmp_path):
    custom = load_custom_reward(write(tmp_path, SINGLE, "claims.py"))
    runner = RewardRunner(5, 1, custom, custom_sources=["mine/*", "exact"])
    assert runner.uses_custom("mine/a") and runner.uses_custom("exact")
    assert not runner.uses_custom("exactly") and not runner.uses_custom("openai/gsm8k")
    mine = run(runner.score("mine/a", "7", "7"))
    assert mine.metrics == {"length": 1.0}  # the custom function's extra metric
    builtin = run(runner.score("openai/gsm8k", "so #### 7", "7"))
    assert builtin.score == 1.0 and "acc" in builtin.metrics  # verl's gsm8k rule
    unknown = run(runner.score("nobody/claims", "7", "7"))
    assert unknown.failed and "no reward function for data_source 'nobody/claims'" in unknown.error


def test_judge_keywords_reach_the_functions_that_declare_them_keys_only_by_name(tmp_path):
    path = write(tmp_path, JUDGE, "judges.py")
    tokenizer = object()
    judge = JudgeAccess(
        reward_servers=lambda: {"reward-0": "http://a:1", "reward-1": "http://b:2/"},
        reward_api_key="rk",
        engines=lambda: {"engine-0": "http://e:3"},
        engine_api_key="ek",
        reward_model_tokenizer=tokenizer,
    )
    everything = load_custom_reward(path)  # **kwargs: the addresses, never the keys
    assert everything.judge_keywords == {
        "reward_router_address", "reward_model_tokenizer", "reward_servers", "engine_urls",
    }  # fmt: skip
    verl = load_custom_reward(path, "verl_judge")
    engines = load_custom_reward(path, "engines_judge")
    for custom in (everything, verl, verl, engines):
        run(RewardRunner(5, 1, custom, judge=judge).score("s", "x", "y"))
    assert everything.fn.__globals__["SEEN"] == [sorted(everything.judge_keywords)]
    # verl's names: host:port of a reward server, round robin from call to call (the first
    # call, by the **kwargs function, took a:1); the reward model's tokenizer
    assert verl.fn.__globals__["SEEN"] == [("b:2", tokenizer), ("a:1", tokenizer)]
    assert engines.fn.__globals__["SEEN"] == [({"engine-0": "http://e:3"}, "ek")]


BAD_BATCH = "def compute_score(data_sources, solution_strs, extra_infos):\n    return []\n"
NO_KWARGS = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n"
)


def test_a_function_the_pipeline_cannot_call_is_refused_at_load_naming_the_file(tmp_path):
    with pytest.raises(RewardLoadError, match=r"as a batched reward function .*ground_truths"):
        load_custom_reward(write(tmp_path, BAD_BATCH, "bad_batch.py"))
    with pytest.raises(RewardLoadError, match=r"no_kwargs\.py.* reward_kwargs \['temperature'\]"):
        load_custom_reward(write(tmp_path, NO_KWARGS, "no_kwargs.py"), reward_kwargs={"temperature": 1})  # fmt: skip
    with pytest.raises(RewardLoadError, match=r"reward_kwargs \['ground_truth'\] .* would replace"):
        load_custom_reward(write(tmp_path, SINGLE, "clash.py"), reward_kwargs={"ground_truth": "x"})  # fmt: skip
    with pytest.raises(RewardLoadError, match=r"importing custom reward file .*syntax\.py failed"):
        load_custom_reward(write(tmp_path, "def compute_score(:\n", "syntax.py"))
