"""Process body for the sequence-parallel test: logprobs, gradients and one step, written by rank 0.

Runs a ``LearnerWorker`` with ``sequence_parallel = world_size`` (one SP group)
or a single rank. The gradient probe is the full gradient of Σ_t c_t·logp_t
(fixed c) over the batch's micro-batches, scaled by the world size as the
learner's losses are (FSDP averages over ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from learner.batching import GlobalBatch
from learner.packing import policy_forward
from tests.integration.learner import procs


def run_sp(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(out_dir)
    overrides = {
        "sequence_parallel": world_size,
        "num_ranks": world_size,
        "critic": {"optim": {"lr": 1e-3}, "value_head_init_std": 0.1},  # values not all zero
    }
    worker = procs.make_worker(model_dir, rank, world_size, port, overrides)
    try:
        batch = procs.make_batch(0)
        gb = GlobalBatch.from_arrow(batch)
        plan = worker._plan(gb, np.arange(gb.size))
        logprobs = worker._infer(worker.policy, gb, plan, values=False)
        values = worker._infer(worker.critic, gb, plan, values=True)
        coef = torch.linspace(-1.0, 1.0, int(gb.response_lens.sum()))
        for indices in plan:
            mb = worker._inputs(gb, indices)
            lp = policy_forward(worker.policy, mb, sp=worker.sp)
            positions = [
                np.arange(gb.response_offsets[i], gb.response_offsets[i + 1]) for i in indices
            ]
            picked = coef[np.concatenate(positions)] if len(indices) else coef[:0]
            ((lp.logprobs * picked).sum() * world_size + lp.anchor).backward()
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in worker.policy.named_parameters()
        }
        worker.optimizer.zero_grad(set_to_none=True)
        metrics = worker.step(batch if rank == 0 else None, policy_version=0)
        weights = procs.full_weights(worker)
        if rank == 0:
            torch.save(
                {"logprobs": logprobs, "values": values, "grads": grads, "weights": weights},
                out / f"sp{world_size}.pt",
            )
            (out / f"sp{world_size}_metrics.json").write_text(json.dumps(metrics))
    finally:
        worker.close()
