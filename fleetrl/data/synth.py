"""Synthetic verifiable tasks a tiny character-level model can learn by RL on a CPU.

Each task enumerates a small, finite instance space of (prompt text, answer)
pairs; every answer is a short digit string (one to three tokens with the
project's character tokenizer, so ``max_new_tokens`` of 4 is enough):

- ``add``        "3+5=" -> "8": single-digit addition, 100 instances.
- ``add2``       "47+8=" -> "55": a number below 100 plus a digit, 1,000 instances
                 (200 held out: enough distinct prompts for a held-out score that
                 moves in steps of 0.005, and a carry to learn).
- ``copy_last``  "last:4172=" -> "2": the last digit of 2-4 digits, 11,100 instances.
- ``count``      "count a:abba=" -> "2": the number of a's in 1-8 letters a/b, 510 instances.
- ``calc``       "What is 47*86+3? ..." -> "4045": two two-digit numbers multiplied plus
                 a digit, 81,000 instances. A multi-turn task: the prompt offers the
                 ``calculator`` environment (``rollout.multi_turn.env: calculator``;
                 the policy writes ``<calc>EXPR</calc>``, the tool replies) and asks
                 for the answer after ``####``. Answers are up to 4 digits and a
                 conversation needs room: give ``max_new_tokens`` 64 or more.
- ``calc_tool``  "What is 47*86+3?" -> "4045": the same instances asked plainly, for an
                 agent program that offers the policy a calculator as an OpenAI tool
                 (``examples/agents/calculator_agent.py``, ``make demo-agent``).

Train/test split (the demo reports the held-out score): the instance space is
shuffled with ``seed`` and ``HOLDOUT_FRACTION`` of it (at least one instance) is
held out. Test rows are drawn from the held-out instances only and train rows
from the rest only, so no test prompt is ever trained on. Within a split, rows
walk through successive shuffled passes of that split's instances: each
instance appears equally often (±1), with repeats only once the split is
exhausted (for ``add``, 80 train instances serve a 2,000-row train set).

Scoring: ``data_source`` is ``synth/<task>``; the scorer in
``rollout_fleet.rewards.synth`` gives 1.0 when the completion, cut at its first
end-of-turn marker and stripped of whitespace, equals the answer exactly.
``synth/calc`` has its own (``rollout_fleet.rewards.synth_calc``): the number
after the last ``####`` of the whole response.

Run: ``fleetrl data synth --task add --out data/add --train-size 2000 --test-size 200 --seed 0``.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleetrl.data.schema import DatasetError, write_rows
from fleetrl.log import get_logger

log = get_logger(__name__)

HOLDOUT_FRACTION = 0.2


class SynthTaskError(ValueError):
    """Unknown synthetic task or bad sizes."""


@dataclass(frozen=True)
class SynthTask:
    name: str
    description: str
    instances: Callable[[], list[tuple[str, str]]]  # every (prompt content, answer) pair

    @property
    def data_source(self) -> str:
        return f"synth/{self.name}"


def _add_instances() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def _add2_instances() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(100) for b in range(10)]


def _copy_last_instances() -> list[tuple[str, str]]:
    return [
        (f"last:{''.join(digits)}=", digits[-1])
        for length in (2, 3, 4)
        for digits in itertools.product("0123456789", repeat=length)
    ]


def _count_instances() -> list[tuple[str, str]]:
    return [
        (f"count a:{''.join(letters)}=", str(letters.count("a")))
        for length in range(1, 9)
        for letters in itertools.product("ab", repeat=length)
    ]


CALC_PROMPT = (
    "What is {expression}? You may write <calc>EXPR</calc> to use a calculator. "
    "End with #### followed by the answer."
)


def _calc_instances() -> list[tuple[str, str]]:
    return [
        (CALC_PROMPT.format(expression=f"{a}*{b}+{c}"), str(a * b + c))
        for a in range(10, 100)
        for b in range(10, 100)
        for c in range(10)
    ]


def _calc_tool_instances() -> list[tuple[str, str]]:
    return [
        (f"What is {a}*{b}+{c}?", str(a * b + c))
        for a in range(10, 100)
        for b in range(10, 100)
        for c in range(10)
    ]


TASKS: dict[str, SynthTask] = {
    task.name: task
    for task in (
        SynthTask("add", "single-digit addition a+b=", _add_instances),
        SynthTask("add2", "a number below 100 plus a digit a+b=", _add2_instances),
        SynthTask("copy_last", "copy the last of 2-4 digits", _copy_last_instances),
        SynthTask("count", "count the a's in 1-8 letters a/b", _count_instances),
        SynthTask("calc", "a*b+c with a calculator tool (multi-turn)", _calc_instances),
        SynthTask(
            "calc_tool", "a*b+c asked plainly, for an agent with a tool", _calc_tool_instances
        ),
    )
}


def get_task(name: str) -> SynthTask:
    if name not in TASKS:
        raise SynthTaskError(f"unknown synthetic task {name!r}; accepted: {', '.join(TASKS)}")
    return TASKS[name]


def split_instances(
    task: SynthTask, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train instances, held-out instances): a seeded shuffle of the space, cut once."""
    space = task.instances()
    order = np.random.default_rng([seed, 0]).permutation(len(space))
    held_out = max(1, math.ceil(HOLDOUT_FRACTION * len(space)))
    test = [space[i] for i in order[:held_out]]
    train = [space[i] for i in order[held_out:]]
    return train, test


def _draw(
    instances: list[tuple[str, str]], size: int, rng: np.random.Generator
) -> list[tuple[str, str]]:
    """``size`` instances from successive shuffled passes over ``instances``."""
    drawn: list[tuple[str, str]] = []
    while len(drawn) < size:
        drawn.extend(instances[i] for i in rng.permutation(len(instances)))
    return drawn[:size]


def make_rows(task: SynthTask, split: str, size: int, seed: int) -> list[dict[str, Any]]:
    """Schema rows of one split of ``task`` (deterministic in ``seed``)."""
    train, test = split_instances(task, seed)
    instances = train if split == "train" else test
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    return [
        {
            "data_source": task.data_source,
            "prompt": [{"role": "user", "content": content}],
            "ability": "synth",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "task": task.name},
        }
        for index, (content, answer) in enumerate(_draw(instances, size, rng))
    ]


def write_synth_dataset(
    task: str, out_dir: str | Path, train_size: int, test_size: int, seed: int
) -> tuple[Path, Path]:
    """Write ``out_dir/train.parquet`` and ``out_dir/test.parquet``; return their paths."""
    spec = get_task(task)
    if train_size < 1 or test_size < 1:
        raise SynthTaskError(
            f"--train-size ({train_size}) and --test-size ({test_size}) must be >= 1"
        )
    out = Path(out_dir)
    train_path = write_rows(make_rows(spec, "train", train_size, seed), out / "train.parquet")
    test_path = write_rows(make_rows(spec, "test", test_size, seed), out / "test.parquet")
    log.info(
        "wrote synth/%s: %d train rows, %d test rows (held-out instances only) to %s",
        task,
        train_size,
        test_size,
        out,
    )
    return train_path, test_path


def main(args: argparse.Namespace) -> int:
    try:
        write_synth_dataset(args.task, args.out, args.train_size, args.test_size, args.seed)
    except (SynthTaskError, DatasetError) as err:
        log.error("%s", err)
        return 2
    return 0
