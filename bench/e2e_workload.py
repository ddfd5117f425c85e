"""The e2e suite's workload: a task whose responses have long-tailed lengths, and its model.

A synchronous trainer loses time when a few samples of a batch generate far
longer than the rest (reasoning models: most answers short, some very long);
an asynchronous one keeps generating while it trains. The synthetic tasks have
one- or two-token answers, so this module makes the lengths long-tailed the way
a real model's are, by the model's own behaviour rather than by the harness:

- each train prompt gets a length target L drawn from a lognormal (median and
  sigma from ``E2ESizes``), clipped to ``[2, rollout.max_new_tokens]``;
- the tiny model is warm-started (``learner.sft.supervised_warmstart``) on the
  answer followed by L - len(answer) spaces, then end-of-turn. It cannot see L,
  so it learns a stopping hazard: most responses stop early, some run long,
  and a few reach the cap. The reward is unchanged: the synth scorer strips
  surrounding whitespace, so "8" followed by spaces scores as "8".
- label noise is applied before padding (a wrong answer is padded like a right
  one), so response length carries no information about correctness.

The train rows also carry ``extra_info.max_new_tokens = L`` (a worker that honours
per-prompt budgets caps each sample there). Validation rows are unchanged.
Left out: prompts whose difficulty predicts their length (real long tails come
partly from hard prompts; here length and prompt are independent).
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetrl.log import get_logger

if TYPE_CHECKING:
    from bench.e2e import E2ESizes

log = get_logger(__name__)

PAD = " "  # stripped by the synth scorer, one token with the tiny character tokenizer
PROMPT_ALLOWANCE = 48  # tokens of a chat-templated synth prompt, with room to spare


def long_tail_budgets(count: int, sizes: E2ESizes, seed: int) -> np.ndarray:
    """Per-prompt length targets: lognormal(log median, sigma), rounded, in [2, cap]."""
    rng = np.random.default_rng([seed, 7])
    draws = rng.lognormal(math.log(sizes.budget_median), sizes.budget_sigma, size=count)
    return np.clip(np.rint(draws), 2, sizes.max_new_tokens).astype(np.int64)


def write_long_tail_data(data_dir: Path, sizes: E2ESizes) -> tuple[Path, Path, dict[str, Any]]:
    """Train Parquet whose rows carry a length target, validation Parquet without; plus stats."""
    from fleetrl.data.schema import write_rows
    from fleetrl.data.synth import get_task, make_rows

    task = get_task(sizes.task)
    train_rows = make_rows(task, "train", sizes.train_size, sizes.seed)
    budgets = long_tail_budgets(len(train_rows), sizes, sizes.seed)
    for row, budget in zip(train_rows, budgets, strict=True):
        row["extra_info"] = {**row["extra_info"], "max_new_tokens": int(budget)}
    train = write_rows(train_rows, data_dir / "train.parquet")
    val = write_rows(make_rows(task, "test", sizes.val_size, sizes.seed), data_dir / "val.parquet")
    stats = {
        "distribution": f"lognormal(median={sizes.budget_median}, sigma={sizes.budget_sigma}),"
        f" clipped to [2, {sizes.max_new_tokens}]",
        "mean": float(budgets.mean()),
        "p50": float(np.percentile(budgets, 50)),
        "p90": float(np.percentile(budgets, 90)),
        "p99": float(np.percentile(budgets, 99)),
        "max": int(budgets.max()),
    }
    return train, val, stats


def padded_examples(
    train_file: Path, label_noise: float, seed: int
) -> list[tuple[list[dict[str, str]], str]]:
    """(messages, answer padded to the row's length target) with label noise applied first."""
    import pyarrow.parquet as pq

    from learner.sft import corrupt_answer

    table = pq.read_table(train_file, columns=["prompt", "reward_model", "extra_info"])
    rng = random.Random(seed)
    examples = []
    for prompt, reward, info in zip(
        table.column("prompt").to_pylist(),
        table.column("reward_model").to_pylist(),
        table.column("extra_info").to_pylist(),
        strict=True,
    ):
        answer = str(reward["ground_truth"])
        if rng.random() < label_noise:
            answer = corrupt_answer(answer)
        target = int(info["max_new_tokens"]) - 1  # the end-of-turn token is the last one
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        examples.append((messages, answer + PAD * max(0, target - len(answer))))
    return examples


def max_positions_for(sizes: E2ESizes) -> int:
    """Context length that fits a templated prompt plus the response cap (multiple of 16)."""
    return int(math.ceil((PROMPT_ALLOWANCE + sizes.max_new_tokens) / 16) * 16)


def build_model(
    model_dir: Path, train_file: Path, sizes: E2ESizes, warmstart: Any, tiny: Any
) -> Path:
    """Build and warm-start the tiny model at ``model_dir`` unless it is already there.

    ``warmstart`` and ``tiny`` are the base config's ``model.warmstart`` and
    ``model.tiny`` sections (shape, lr, batch size and label noise come from
    there; steps from ``sizes`` when set). The folder appears complete or not at all.
    """
    import msgspec

    from fleetrl.models.tiny import make_tiny_model
    from learner.sft import supervised_warmstart

    if (model_dir / "config.json").is_file():
        log.info("e2e: reusing the warm-started model at %s", model_dir)
        return model_dir
    steps = warmstart.steps if sizes.warmstart_steps is None else sizes.warmstart_steps
    tmp = model_dir.with_name(model_dir.name + ".partial")
    if tmp.exists():  # left by an interrupted build
        shutil.rmtree(tmp)
    make_tiny_model(
        tmp,
        arch=tiny.arch,
        layers=sizes.layers,
        hidden=sizes.hidden,
        heads=tiny.heads,
        max_positions=max_positions_for(sizes),
        seed=tiny.seed,
    )
    if steps:
        examples = padded_examples(train_file, warmstart.label_noise, warmstart.seed)
        # noise is already in the examples: the warm start must not add its own
        plain = msgspec.structs.replace(warmstart, steps=steps, label_noise=0.0)
        loss = single_threaded(supervised_warmstart, tmp, examples, plain)
        log.info("e2e: warm start %d steps on padded answers, final loss %.3f", steps, loss)
    tmp.replace(model_dir)
    return model_dir


def single_threaded(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on one torch thread: on a shared, loaded CPU a tiny model's warm start
    ran 50x slower on two threads than on one (OpenMP workers spin on busy cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)
