"""Learner throughput: tokens/s with sequence packing vs right padding, same run, same model.

A long-tailed mix of response lengths (lognormal) is where padding wastes the
most compute: every row of a padded micro-batch costs the longest row. One
single-rank ``LearnerWorker`` (CPU gloo or one GPU) trains on the same
synthetic batch (one long-tailed length mix), both arms in each repetition, their order
alternated (packed first, then padded first) so drift in a shared machine's load
hits both alike; each arm's figure in a repetition is its fastest of
``STEPS_PER_ARM`` steps. ``summary.packed_vs_padded`` (> 1: packing is faster) is the
median over repetitions of the paired ratio packed tokens/s ÷ padded tokens/s of
the same batch, with its spread (min, max, interquartile range); ``reps`` is
large enough (quick 12, full 10) for that spread to be read. A benchmark, not a
test: nothing is asserted.

Run: ``python -m bench.learner --out DIR [--quick] [--reps N] [--hidden 64] [--layers 2]``
(writes ``DIR/learner.json``). ``fleetrl bench learner`` calls ``run``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Steps per arm per repetition; the fastest counts (a step that lost the CPU to a
# neighbour measures the neighbour, not the arm).
STEPS_PER_ARM = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartiles (the value itself when there is only one)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def alternate_packing(
    worker: Any, batch: Any, reps: int, *, deadline: float | None = None
) -> dict[str, list[float]]:
    """Tokens/s of ``worker`` (a set-up ``LearnerWorker``) on ``batch`` with packing on and off.

    A warm-up repetition of both arms (discarded), then up to ``reps`` repetitions, the
    order of the arms alternated; each arm's figure in a repetition is its fastest of
    ``STEPS_PER_ARM`` steps. With ``deadline`` (``time.monotonic()``) repetitions stop once
    it has passed, after at least one. The worker keeps the last arm's config.
    """
    import msgspec

    cfg = worker.cfg
    samples: dict[str, list[float]] = {"packed": [], "padded": []}
    for rep in range(reps + 1):  # rep 0 warms up both arms and is discarded
        if rep > 1 and deadline is not None and time.monotonic() >= deadline:
            break
        arms = ("packed", "padded") if rep % 2 == 0 else ("padded", "packed")
        for arm in arms:
            worker.cfg = msgspec.structs.replace(cfg, packing=arm == "packed")
            rates = []
            for _ in range(STEPS_PER_ARM):
                metrics = worker.step(batch, policy_version=rep)
                rates.append(metrics["perf/total_num_tokens"] / metrics["timing_s/step"])
            if rep:
                samples[arm].append(max(rates))
    return samples


def paired_ratios(samples: dict[str, list[float]]) -> list[float]:
    """Packed ÷ padded tokens/s of each repetition."""
    return [p / q for p, q in zip(samples["packed"], samples["padded"], strict=True)]


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    import msgspec
    import torch

    from fleetrl.models.config import ModelConfig
    from fleetrl.models.tiny import make_tiny_model
    from learner.config import LearnerConfig
    from learner.synthetic import lognormal_lengths, synthetic_batch
    from learner.worker import LearnerWorker

    reps = reps or (12 if quick else 10)
    hidden = hidden or (64 if quick else 128)
    layers = layers or 2
    groups, group_size = (4, 4) if quick else (8, 8)
    median, cap = (24, 256) if quick else (64, 1024)
    budget = 512 if quick else 4096
    if device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "model", layers=layers, hidden=hidden, heads=4, max_positions=cap + 64
        )
        cfg = msgspec.convert(
            {
                "optim": {"lr": 1e-6},
                "correction": {"mode": "bypass"},
                "max_tokens_per_micro_batch": budget,
            },
            LearnerConfig,
        )
        worker = LearnerWorker(
            cfg, ModelConfig(path=str(model_dir)), rank=0, world_size=1,
            master_addr="127.0.0.1", master_port=_free_port(), seed=0, device=device,
        )  # fmt: skip
        worker.setup()
        n = groups * group_size
        try:
            # One batch for every repetition: its length mix is the workload, so the spread
            # of the paired ratios is measurement noise, not a different workload per pair.
            lens = lognormal_lengths(n, median=median, sigma=1.0, low=1, high=cap, seed=0)
            batch = synthetic_batch(
                vocab_size=60, groups=groups, group_size=group_size, prompt_lens=16,
                response_lens=lens.tolist(), seed=0,
            )  # fmt: skip
            samples = alternate_packing(worker, batch, reps)
        finally:
            worker.close()
    medians = {arm: statistics.median(v) for arm, v in samples.items()}
    paired = paired_ratios(samples)
    q25, q75 = _quartiles(paired)
    result = {
        "suite": "learner",
        "config": {
            "device": device,
            "hidden": hidden,
            "layers": layers,
            "reps": reps,
            "batch": n,
            "median_response": median,
            "max_response": cap,
            "max_tokens_per_micro_batch": budget,
        },  # fmt: skip
        "tokens_per_s": {arm: {"median": m, "samples": samples[arm]} for arm, m in medians.items()},
        "paired_ratios": paired,
        "summary": {
            "packed_vs_padded": statistics.median(paired),
            "packed_vs_padded_min": min(paired),
            "packed_vs_padded_max": max(paired),
            "packed_vs_padded_q25": q25,
            "packed_vs_padded_q75": q75,
            "ratio_of_medians": medians["packed"] / medians["padded"],
            "reps": reps,
        },
    }
    (out_dir / "learner.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    from fleetrl.log import setup_logging

    setup_logging("bench")
    result = run(args.out, args.quick, args.reps, args.hidden, args.layers, args.device)
    json.dump(result["summary"], sys.stdout)  # entry point: the headline on stdout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
