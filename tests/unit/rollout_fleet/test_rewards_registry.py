"""Reward registry: verl names, synth exact match, prefix patterns, custom functions from a file."""

from __future__ import annotations

import pytest

from rollout_fleet.rewards import (
    RewardLoadError,
    RewardRegistry,
    UnknownDataSourceError,
    compute_score,
    default_registry,
    load_custom_reward,
)
from rollout_fleet.rewards.synth import final_text


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("8", 1.0),
        (" 8\n", 1.0),
        ("8<|im_end|>", 1.0),
        ("8<|im_end|>garbage after the turn", 1.0),
        ("89", 0.0),
        ("8 9", 0.0),
        ("8\n9", 0.0),
        ("", 0.0),
        ("<|im_end|>8", 0.0),
        ("eight", 0.0),
    ],
)
def test_synth_scores_exact_match_of_the_completion_up_to_end_of_turn(completion, expected):
    for source in ("synth/add", "synth/copy_last", "synth/count"):
        assert compute_score(source, completion, "8")["score"] == expected


def test_final_text_cuts_at_the_earliest_end_marker():
    assert final_text(" 12 </s> x <|im_end|>") == "12"


def test_unknown_source_names_the_registered_ones():
    with pytest.raises(
        UnknownDataSourceError, match="'nope/x'; registered: .*openai/gsm8k.*synth/\\*"
    ):
        compute_score("nope/x", "1", "1")


def test_register_exact_beats_prefix_and_longer_prefix_beats_shorter():
    registry = RewardRegistry()
    registry.register("task/*", lambda **kw: 1.0)
    registry.register("task/special/*", lambda **kw: 2.0)
    registry.register("task/special/one", lambda **kw: 3.0)
    assert registry.compute_score("task/a", "", "") == 1.0
    assert registry.compute_score("task/special/two", "", "") == 2.0
    assert registry.compute_score("task/special/one", "", "") == 3.0
    with pytest.raises(TypeError, match="must be callable"):
        registry.register("x", "not a function")  # type: ignore[arg-type]


def test_register_replaces_a_builtin_only_in_that_registry():
    registry = default_registry()
    registry.register("openai/gsm8k", lambda **kw: 0.5)
    assert registry.compute_score("openai/gsm8k", "#### 1", "1") == 0.5
    assert compute_score("openai/gsm8k", "#### 1", "1")["score"] == 1.0


CUSTOM = """
CALLS = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(data_source)
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}

def two_args(solution_str, ground_truth):
    return 1.0

NOT_CALLABLE = 3
"""


def test_custom_reward_loads_from_a_file_path_and_is_called_with_keywords(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    loaded = load_custom_reward(path, "compute_score")
    assert not loaded.batched and not loaded.is_async and loaded.judge_keywords == frozenset()
    fn = loaded.fn
    result = fn(data_source="d", solution_str=" 4", ground_truth="4", extra_info=None)
    assert result == {"score": 1.0, "length": 2}
    registry = RewardRegistry()
    registry.register("mine", fn)
    assert registry.compute_score("mine", "5", "4")["score"] == 0.0


def test_custom_reward_errors_name_the_file_and_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    with pytest.raises(RewardLoadError, match=r"absent\.py not found"):
        load_custom_reward(tmp_path / "absent.py")
    with pytest.raises(
        RewardLoadError, match=r"defines no 'score_fn'; callables found: compute_score, two_args"
    ):
        load_custom_reward(path, "score_fn")
    with pytest.raises(RewardLoadError, match="'NOT_CALLABLE' .* is a int, not callable"):
        load_custom_reward(path, "NOT_CALLABLE")
    with pytest.raises(
        RewardLoadError, match="cannot be called as a reward function with keywords data_source"
    ):
        load_custom_reward(path, "two_args")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardLoadError, match=r"importing custom reward file .*broken\.py failed"):
        load_custom_reward(broken)
