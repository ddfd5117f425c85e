"""The demo's synthetic preference sets: labelled by their rule, on the RL task's own split."""

from __future__ import annotations

import typing
from pathlib import Path

from fleetrl.data import synth, synth_preference
from fleetrl.data.config import PreferenceDataConfig
from fleetrl.data.preference import read_preference_rows
from rollout_fleet.rewards.custom import load_custom_reward

REPO = Path(__file__).resolve().parents[3]


def _sum(row) -> int:
    """The correct answer of an add2 prompt ("47+8=" -> 55)."""
    a, b = row["prompt"][0]["content"].rstrip("=").split("+")
    return int(a) + int(b)


def _prompts(rows) -> set[str]:
    return {r["prompt"][0]["content"] for r in rows}


def test_add2_even_pairs_are_labelled_by_the_shipped_rule(tmp_path):
    rule = load_custom_reward(REPO / "configs/rules/even_answer.py").fn
    train, test = synth_preference.write_preference_set("add2_even", tmp_path, 600, 200, seed=1)
    for rows in (read_preference_rows(train), read_preference_rows(test)):
        for row in rows:
            assert rule(data_source="synth/add2", solution_str=row["chosen"], ground_truth="", extra_info=None) == 1.0  # fmt: skip
            assert rule(data_source="synth/add2", solution_str=row["rejected"], ground_truth="", extra_info=None) == 0.0  # fmt: skip
    rows = read_preference_rows(train)
    sums = [_sum(r) for r in rows]
    near = [{int(r["chosen"]), int(r["rejected"])} == {s, s + 1} for r, s in zip(rows, sums, strict=True)]  # fmt: skip
    assert 0.5 < sum(near) / len(near) < 0.7  # the policy's own two answers, 60 % of pairs


def test_the_rule_reads_the_response_as_the_rl_scorer_does():
    rule = load_custom_reward(REPO / "configs/rules/even_answer.py").fn

    def score(text: str) -> float:
        return rule(data_source="synth/add2", solution_str=text, ground_truth="7", extra_info=None)

    assert [score(t) for t in ("8", " 12\n", "8<|im_end|>x", "0")] == [1.0, 1.0, 1.0, 1.0]
    assert [score(t) for t in ("7", "8a", "", "-2", "²", "8 8")] == [0.0] * 6


def test_held_out_pairs_use_only_the_rl_task_s_held_out_prompts(tmp_path):
    for task in synth_preference.TASKS:
        train, test = synth_preference.write_preference_set(task, tmp_path / task, 800, 200, seed=1)
        rl_train = _prompts(synth.make_rows(synth.get_task("add2"), "train", 800, seed=1))
        rl_test = _prompts(synth.make_rows(synth.get_task("add2"), "test", 200, seed=1))
        pref_train, pref_test = _prompts(read_preference_rows(train)), _prompts(read_preference_rows(test))  # fmt: skip
        assert pref_test <= {c for c, _ in synth.split_instances(synth.get_task("add2"), 1)[1]}
        assert not pref_test & pref_train and not pref_test & rl_train
        assert pref_test & rl_test  # the very prompts the RL run is validated on


def test_add2_pairs_prefer_the_correct_sum_over_the_policy_s_kind_of_mistakes(tmp_path):
    train, _ = synth_preference.write_preference_set("add2", tmp_path, 1000, 10, seed=1)
    rows = read_preference_rows(train)
    diffs = []
    for row in rows:
        total = _sum(row)
        assert int(row["chosen"]) == total and int(row["rejected"]) != total
        diffs.append(int(row["rejected"]) - total)
    assert 0.3 < diffs.count(1) / len(diffs) < 0.5  # the warm start's sum + 1


def test_config_names_exactly_the_tasks_there_are():
    hint = typing.get_type_hints(PreferenceDataConfig, include_extras=True)["synth_task"]
    assert set(typing.get_args(typing.get_args(hint)[0])) == {"", *synth_preference.TASKS}
