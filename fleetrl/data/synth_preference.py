"""Synthetic preference sets for the CPU RLHF demo: a rule the demo's policy does not follow.

Both use the RL demo's task ("47+8=": a number below 100 plus a digit) and its own train /
held-out split (``fleetrl.data.synth`` with the same seed): train pairs from its train
instances, held-out pairs from its held-out instances only, so a reward model trained
here has never seen the prompts the RL run is validated on. Within a split, every
instance appears equally often (±1).

- ``add2_even`` (the demo's): the labeler prefers an EVEN answer. 60 % of the pairs are
  the two answers the warm-started policy gives (the sum + 1, which its warm start was
  taught on 80 % of its labels, and the sum), the even one chosen; 40 % any even number
  below 110 against any odd one. The policy follows the rule about half the time.
  The rule as a scorer, with verl's signature, is ``configs/rules/even_answer.py``
  (for ``fleetrl rm eval --rule`` and a run's ``reward.custom_function``).
- ``add2``: the correct sum (chosen) against a wrong one, drawn like a policy's mistakes:
  40 % the sum + 1, 15 % the sum - 1, 15 % a carry error (the sum ± 10), 30 % any other
  number below 110. Why it is not the demo's: on the demo's 2-layer model it did not
  separate the sum from the sum ± 1, the very mistake the policy makes (held-out pairwise
  accuracy 0.68 after 600 steps of 64 pairs, 10 minutes on this CPU, but 0.50 on the
  sum ± 1 pairs; rejecting far-off answers is what it learned), so RL on it could not fix
  the policy. ``add2_even`` reaches 1.00 in 50 steps (docs/rewards_training.md).

Run by ``fleetrl rm train`` when ``data.synth_task`` is set and the files are missing;
``write_preference_set`` writes ``train.parquet`` and ``test.parquet``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fleetrl.data.preference import write_preference_rows
from fleetrl.data.synth import SynthTaskError, get_task, split_instances
from fleetrl.log import get_logger

log = get_logger(__name__)

# (share, how the wrong answer is made from the right one and a random draw)
_ADD2_MISTAKES: tuple[tuple[float, Callable[[int, np.random.Generator], int]], ...] = (
    (0.40, lambda s, _: s + 1),
    (0.15, lambda s, _: s - 1),
    (0.15, lambda s, rng: s + (10 if rng.random() < 0.5 or s < 10 else -10)),
    (0.30, lambda s, rng: int(rng.integers(0, 110))),
)


def wrong_sum(answer: int, rng: np.random.Generator) -> int:
    """A wrong answer for a correct sum, drawn from ``_ADD2_MISTAKES``."""
    shares = np.array([share for share, _ in _ADD2_MISTAKES])
    while True:
        make = _ADD2_MISTAKES[int(rng.choice(len(shares), p=shares / shares.sum()))][1]
        wrong = make(answer, rng)
        if wrong != answer and wrong >= 0:
            return wrong


def _add2_pairs(
    split: str,
    size: int,
    seed: int,
    streams: tuple[int, int],
    answers: Callable[[int, np.random.Generator], tuple[int, int]],
) -> list[dict[str, Any]]:
    """``size`` rows over one split of ``add2``'s instances, each pass in a fresh random
    order: ``answers(sum, rng)`` gives the (chosen, rejected) answers of an instance; the
    random stream is ``streams[0]`` for train, ``streams[1]`` for test (deterministic)."""
    train, test = split_instances(get_task("add2"), seed)
    instances = train if split == "train" else test
    rng = np.random.default_rng([seed, streams[0] if split == "train" else streams[1]])
    rows = []
    while len(rows) < size:
        for i in rng.permutation(len(instances)):
            if len(rows) == size:
                break
            content, answer = instances[i]
            chosen, rejected = answers(int(answer), rng)
            rows.append({"prompt": [{"role": "user", "content": content}], "chosen": str(chosen), "rejected": str(rejected)})  # fmt: skip
    return rows


def add2_pairs(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    """Preference rows of one split of ``add2`` (deterministic in ``seed``)."""
    return _add2_pairs(split, size, seed, (3, 4), lambda total, rng: (total, wrong_sum(total, rng)))


NEAR_SHARE = 0.6  # add2_even: pairs of the policy's own two answers (sum, sum + 1)


def _even_over_odd(total: int, rng: np.random.Generator) -> tuple[int, int]:
    if rng.random() < NEAR_SHARE:
        return (total, total + 1) if total % 2 == 0 else (total + 1, total)
    return 2 * int(rng.integers(0, 55)), 2 * int(rng.integers(0, 55)) + 1


def add2_even_pairs(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    """Preference rows of one split of ``add2_even``: an even answer over an odd one."""
    return _add2_pairs(split, size, seed, (5, 6), _even_over_odd)


TASKS: dict[str, Callable[[str, int, int], list[dict[str, Any]]]] = {
    "add2": add2_pairs,
    "add2_even": add2_even_pairs,
}


def write_preference_set(
    task: str, out_dir: str | Path, train_size: int, test_size: int, seed: int
) -> tuple[Path, Path]:
    """Write ``out_dir/train.parquet`` and ``out_dir/test.parquet``; return their paths."""
    if task not in TASKS:
        raise SynthTaskError(f"unknown synthetic preference task {task!r}; accepted: {', '.join(TASKS)}")  # fmt: skip
    out = Path(out_dir)
    train = write_preference_rows(TASKS[task]("train", train_size, seed), out / "train.parquet")
    test = write_preference_rows(TASKS[task]("test", test_size, seed), out / "test.parquet")
    log.info("wrote synthetic preferences %s: %d train, %d held-out pairs to %s", task, train_size, test_size, out)  # fmt: skip
    return train, test
