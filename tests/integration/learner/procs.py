"""Process bodies for the learner-group tests (spawned with torch.multiprocessing).

Each body builds a ``LearnerWorker`` for its rank, runs a scripted sequence of
steps and writes what the test compares (full weights, metrics, names) under
``out_dir`` from rank 0. Lives in its own module so spawn can import it by name.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import msgspec
import torch

from fleetrl.models.config import ModelConfig
from learner.checkpoint import latest_complete_checkpoint
from learner.config import LearnerConfig
from learner.synthetic import synthetic_batch
from learner.worker import LearnerWorker

RESPONSE_LENS = [1, 4, 9, 12, 3, 3, 0, 8, 20, 2, 5, 6]
VERSIONS = [0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]

BASE_CONFIG: dict[str, Any] = {
    # eps 1e-6, not AdamW's 1e-8: an embedding row whose true gradient is ~0 gets a
    # rounding-level gradient (~1e-9) that differs with the summation order (micro-batch
    # split, rank count, the CPU's kernels); with eps 1e-8 AdamW's first step turns that
    # into an update of up to ~lr/10 (measured 6.7e-5 apart at lr 1e-3), which is no
    # statement about the split. With 1e-6 it stays below 1e-6; real gradients (>= 1e-4)
    # are unaffected.
    "optim": {"lr": 1e-3, "warmup_steps": 1, "eps": 1e-6},
    "algorithm": {"adv_estimator": "gae", "gamma": 0.99, "lam": 0.95},
    "policy_loss": {"entropy_coeff": 0.01},
    "kl": {"use_kl_loss": True, "kl_loss_coef": 0.1},
    "critic": {"optim": {"lr": 1e-3}},
    "ppo_mini_batch_size": 2,
    "max_tokens_per_micro_batch": 24,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(body, world_size: int, *args) -> None:
    """Run ``body(rank, world_size, port, *args)`` in ``world_size`` fresh processes."""
    import torch.multiprocessing as mp

    mp.spawn(body, args=(world_size, free_port(), *args), nprocs=world_size, join=True)


def make_batch(step: int):
    lens = RESPONSE_LENS[step % 12 :] + RESPONSE_LENS[: step % 12]
    return synthetic_batch(
        vocab_size=60, groups=3, group_size=4, prompt_lens=[5, 7, 3], response_lens=lens,
        seed=step, token_versions=VERSIONS, temperature=0.7 if step % 2 else 1.0,
    )  # fmt: skip


def make_worker(
    model_dir: str,
    rank: int,
    world_size: int,
    port: int,
    overrides: dict[str, Any],
    max_response_length: int = 0,
) -> LearnerWorker:
    raw = msgspec.convert(BASE_CONFIG, dict)
    for key, value in overrides.items():
        raw[key] = value
    cfg = msgspec.convert(raw, LearnerConfig)
    worker = LearnerWorker(
        cfg, ModelConfig(path=model_dir), rank=rank, world_size=world_size,
        master_addr="127.0.0.1", master_port=port, seed=7, total_steps=4,
        max_response_length=max_response_length,
    )  # fmt: skip
    try:
        worker.setup()
    except BaseException:
        worker.close()  # a setup that failed after joining leaves no group behind
        raise
    return worker


def full_weights(worker: LearnerWorker) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in worker.named_full_tensors()}


def run_rank(
    rank: int, world_size: int, port: int, model_dir: str, out_dir: str, scenario: str,
    overrides: dict[str, Any],
) -> None:  # fmt: skip
    """Scenarios: "train" (4 steps, checkpoint after step 2), "resume" (from it, steps 3-4)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(out_dir)
    worker = make_worker(model_dir, rank, world_size, port, overrides)
    metrics = []
    try:
        first = 0
        if scenario == "resume":
            step_dir = latest_complete_checkpoint(out / "ckpt")
            extra = worker.load_checkpoint(step_dir)
            first = extra["next_step"]
        for step in range(first, 4):
            batch = make_batch(step) if rank == 0 else None
            metrics.append(worker.step(batch, policy_version=step))
            weights = full_weights(worker)  # collective: every rank walks the parameters
            if rank == 0:
                torch.save(weights, out / f"{scenario}_weights_step{step + 1}.pt")
            if scenario == "train" and step == 1:
                worker.save_checkpoint(out / "ckpt", {"next_step": 2})
        if rank == 0:
            (out / f"{scenario}_metrics.json").write_text(json.dumps(metrics))
    finally:
        worker.close()
