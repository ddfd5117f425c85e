"""Process bodies for the reward-model learner tests (spawned with torch.multiprocessing).

Each body builds a ``RewardModelWorker`` for its rank over the tiny model, trains on
pairs drawn by a ``PairCursor`` from a small preference file (rank 0 holds the data, as
in a run) and writes what the test compares under ``out_dir`` from rank 0: full weights
and metrics per step, held-out scores, the exported reward-model folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from fleetrl.data.pairs import PairCursor, PreferencePairs
from fleetrl.data.preference import write_preference_rows
from fleetrl.models.config import ModelConfig
from fleetrl.models.loading import load_tokenizer
from learner.checkpoint import latest_complete_checkpoint
from learner.config import LearnerConfig
from learner.reward_export import write_reward_model
from learner.reward_worker import RewardModelWorker
from tests.integration.learner.procs import free_port, spawn

__all__ = ["free_port", "run_here", "run_rank", "spawn", "write_pairs"]

STEPS = 4
BATCH_PAIRS = 6
# eps 1e-5, not AdamW's 1e-8 (see tests/integration/learner/procs.py): the rows of tokens
# every prompt shares (ChatML's "\n") get gradients of ~1e-6 from chosen and rejected
# sequences that nearly cancel, whose rounding differs with the summation order (ranks,
# micro-batches, packing); AdamW's first step divides by |g| + eps, and with eps 1e-6 that
# moved the "\n" embedding 1.8e-5 apart at lr 1e-3, which says nothing about the split.
BASE_CONFIG: dict[str, Any] = {
    "optim": {"lr": 1e-3, "warmup_steps": 1, "eps": 1e-5, "weight_decay": 0.0},
    "max_tokens_per_micro_batch": 90,
}


def write_pairs(path: Path) -> Path:
    """A small preference file: sums right against wrong, margins on some rows."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "chosen": str(a + b),
            "rejected": str(a + b + 1 + (a % 3) * 7),
            "margin": 0.5 if (a + b) % 4 == 0 else 0.0,
        }
        for a in range(6)
        for b in range(4)
    ]
    return write_preference_rows(rows, path)


def make_worker(model_dir: str, rank: int, world: int, port: int, overrides: dict[str, Any]) -> RewardModelWorker:  # fmt: skip
    raw = msgspec.convert(BASE_CONFIG, dict)
    raw.update(overrides)
    worker = RewardModelWorker(
        msgspec.convert(raw, LearnerConfig), ModelConfig(path=model_dir), rank=rank,
        world_size=world, master_addr="127.0.0.1", master_port=port, seed=7, total_steps=STEPS,
    )  # fmt: skip
    worker.setup()
    return worker


def full_weights(worker: RewardModelWorker) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in worker.named_full_tensors()}


def run_rank(
    rank: int, world: int, port: int, model_dir: str, data_file: str, out_dir: str,
    scenario: str, overrides: dict[str, Any],
) -> None:  # fmt: skip
    """A spawned rank (deterministic kernels, one thread) of ``run_scenario``."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    run_scenario(rank, world, port, model_dir, data_file, out_dir, scenario, overrides)


def run_here(model_dir: str, data_file: str, out_dir: str, overrides: dict[str, Any]) -> None:
    """The "train" scenario on one rank in this process (no process start to pay for)."""
    torch.set_num_threads(1)
    run_scenario(0, 1, free_port(), model_dir, data_file, out_dir, "train", overrides)


def run_scenario(
    rank: int, world: int, port: int, model_dir: str, data_file: str, out_dir: str,
    scenario: str, overrides: dict[str, Any],
) -> None:  # fmt: skip
    """Scenarios: "train" (STEPS steps, a checkpoint after step 2, held-out scores and the
    exported folder at the end), "resume" (from that checkpoint: steps 3..STEPS)."""
    out = Path(out_dir)
    worker = make_worker(model_dir, rank, world, port, overrides)
    pairs = PreferencePairs([data_file], load_tokenizer(model_dir), max_length=64)
    cursor = PairCursor(len(pairs), shuffle=True, seed=3)
    metrics = []
    try:
        if scenario == "resume":
            extra = worker.load_checkpoint(latest_complete_checkpoint(out / "ckpt"))
            if rank == 0:
                cursor.load_state_dict(extra["cursor"])
        while worker.global_step < STEPS:
            batch = pairs.to_arrow(cursor.take(BATCH_PAIRS)) if rank == 0 else None
            metrics.append(worker.step(batch))
            weights = full_weights(worker)  # collective
            if rank == 0:
                torch.save(weights, out / f"{scenario}_weights_step{worker.global_step}.pt")
            if scenario == "train" and worker.global_step == 2:
                worker.save_checkpoint(out / "ckpt", {"cursor": cursor.state_dict()})
        held_out = pairs.to_arrow(np.arange(len(pairs))) if rank == 0 else None
        chosen, rejected = worker.score(held_out)
        write_reward_model(
            worker.named_full_tensors(), base_path=model_dir, out_dir=out / f"{scenario}_rm",
            rank=rank, stats=None,
        )  # fmt: skip
        if rank == 0:
            (out / f"{scenario}_metrics.json").write_text(json.dumps(metrics))
            np.save(out / f"{scenario}_scores.npy", np.stack([chosen, rejected]))
    finally:
        worker.close()
