"""Synthetic tasks: correct answers, held-out test instances never trained on, determinism."""

from __future__ import annotations

import argparse
import typing

import pyarrow.parquet as pq
import pytest

from fleetrl.data import synth
from fleetrl.data.config import DataConfig
from fleetrl.data.schema import read_rows
from rollout_fleet.rewards import compute_score


def _pairs(rows):
    return [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows]


def _solution(task, answer):
    """A right response in the task's answer format (``synth/calc`` reads it after ####)."""
    return f"<calc>1+1</calc>2 #### {answer}" if task == "calc" else answer


def test_every_task_answer_is_right_and_short():
    instances = {name: task.instances() for name, task in synth.TASKS.items()}
    assert ("3+5=", "8") in instances["add"] and len(instances["add"]) == 100
    assert ("last:4172=", "2") in instances["copy_last"]
    assert ("count a:abba=", "2") in instances["count"]
    assert ("47+8=", "55") in instances["add2"] and len(instances["add2"]) == 1000
    for content, answer in instances["add"] + instances["add2"]:
        a, b = content.removesuffix("=").split("+")
        assert int(answer) == int(a) + int(b)
    for content, answer in instances["count"]:
        assert int(answer) == content.removeprefix("count a:").removesuffix("=").count("a")
    for content, answer in instances["calc"]:
        expression = content.removeprefix("What is ").split("?")[0]
        a, rest = expression.split("*")
        b, c = rest.split("+")
        assert int(answer) == int(a) * int(b) + int(c) and "<calc>EXPR</calc>" in content
    assert len(instances["calc"]) == 81000
    assert ("What is 47*86+3?", "4045") in instances["calc_tool"]
    assert len(instances["calc_tool"]) == 81000
    for name, pairs in instances.items():
        assert len(set(pairs)) == len(pairs), name
        longest = 4 if name.startswith("calc") else 3  # calc: up to 99*99+9
        assert all(1 <= len(answer) <= longest for _, answer in pairs), name


@pytest.mark.parametrize("task", sorted(synth.TASKS))
def test_test_split_holds_only_instances_absent_from_train(tmp_path, task):
    train_path, test_path = synth.write_synth_dataset(task, tmp_path, 500, 50, seed=3)
    train, test = read_rows(train_path), read_rows(test_path)
    assert (len(train), len(test)) == (500, 50)
    assert not set(_pairs(train)) & set(_pairs(test))
    assert {r["data_source"] for r in train + test} == {f"synth/{task}"}
    assert [r["extra_info"]["index"] for r in test] == list(range(50))
    # Every row scores 1.0 with its own answer under the registered scorer.
    for content, answer in _pairs(test):
        assert compute_score(f"synth/{task}", _solution(task, answer), answer)["score"] == 1.0, (
            content
        )


def test_add_train_rows_cover_its_instances_evenly_and_test_rows_are_distinct(tmp_path):
    train_path, test_path = synth.write_synth_dataset("add", tmp_path, 160, 20, seed=0)
    train_pairs = _pairs(read_rows(train_path))
    counts = {pair: train_pairs.count(pair) for pair in train_pairs}
    assert len(counts) == 80 and set(counts.values()) == {2}
    assert len(set(_pairs(read_rows(test_path)))) == 20


def test_same_seed_same_files_other_seed_other_split(tmp_path):
    a = synth.write_synth_dataset("count", tmp_path / "a", 100, 10, seed=1)
    b = synth.write_synth_dataset("count", tmp_path / "b", 100, 10, seed=1)
    c = synth.write_synth_dataset("count", tmp_path / "c", 100, 10, seed=2)
    assert read_rows(a[0]) == read_rows(b[0]) and read_rows(a[1]) == read_rows(b[1])
    assert _pairs(read_rows(a[1])) != _pairs(read_rows(c[1]))


def test_unknown_task_and_bad_sizes_fail_clearly_and_cli_exits_2(tmp_path):
    with pytest.raises(synth.SynthTaskError, match="unknown synthetic task 'mul'; accepted: add"):
        synth.write_synth_dataset("mul", tmp_path, 10, 10, 0)
    with pytest.raises(synth.SynthTaskError, match="--train-size"):
        synth.write_synth_dataset("add", tmp_path, 0, 10, 0)
    args = argparse.Namespace(task="mul", out=str(tmp_path), train_size=1, test_size=1, seed=0)
    assert synth.main(args) == 2
    args.task = "add"
    assert synth.main(args) == 0 and (tmp_path / "train.parquet").is_file()


def test_config_accepts_exactly_the_registered_task_names():
    hint = typing.get_type_hints(DataConfig, include_extras=True)["synth_task"]
    literal = typing.get_args(hint)[0]
    assert set(typing.get_args(literal)) == {"", *synth.TASKS}


def test_add2_holds_out_200_distinct_prompts_never_trained_on(tmp_path):
    train_path, test_path = synth.write_synth_dataset("add2", tmp_path, 2000, 200, seed=0)
    train = pq.read_table(train_path).to_pylist()
    test = pq.read_table(test_path).to_pylist()
    test_prompts = {row["prompt"][0]["content"] for row in test}
    assert len(test_prompts) == 200
    assert not test_prompts & {row["prompt"][0]["content"] for row in train}
