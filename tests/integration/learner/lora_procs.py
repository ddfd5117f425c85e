"""Process body for the LoRA learner tests (spawned with torch.multiprocessing, or run in-process).

Scenario "train": the adapters at init, one step, a probe (policy and reference
logprobs of the next batch, the adapters' gradients of a fixed linear function
of the policy logprobs), three more steps with a checkpoint after step 2.
Scenario "resume": from that checkpoint, steps 3-4. Rank 0 writes everything
the tests compare under ``out_dir`` (file names start with the scenario).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner import dist as ldist
from learner import lora
from learner.batching import GlobalBatch
from learner.checkpoint import latest_complete_checkpoint
from learner.packing import policy_forward
from learner.worker import LearnerWorker
from tests.integration.learner import procs

LORA: dict[str, Any] = {
    "lora": {"rank": 4, "alpha": 8.0},
    "grad_checkpointing": True,
    "optim": {"lr": 1e-2, "warmup_steps": 1},
}


def probe(worker: LearnerWorker, batch) -> dict[str, Any]:
    """Collective: logprobs with adapters on and off, and adapter gradients (then zeroed)."""
    gb = GlobalBatch.from_arrow(
        ldist.broadcast_record_batch(
            batch, rank=worker.rank, world_size=worker.world_size, device=worker.device
        )
    )
    plan = worker._plan(gb, np.arange(gb.size))
    policy = worker._infer(worker.policy, gb, plan, values=False)
    reference = worker._reference_logprobs(gb, plan)
    coef = torch.linspace(-1.0, 1.0, int(gb.response_lens.sum()))
    for indices in plan:
        mb = worker._inputs(gb, indices)
        out = policy_forward(worker.policy, mb, sp=worker.sp)
        spans = [np.arange(gb.response_offsets[i], gb.response_offsets[i + 1]) for i in indices]
        picked = coef[np.concatenate(spans)] if len(indices) else coef[:0]
        ((out.logprobs * picked).sum() * worker.world_size + out.anchor).backward()
    grads = {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for name, p in worker.policy.named_parameters()
        if p.requires_grad
    }
    frozen_grads = [
        n for n, p in worker.policy.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    worker.optimizer.zero_grad(set_to_none=True)
    return {"policy": policy, "reference": reference, "grads": grads, "frozen_grads": frozen_grads}


def base_weights(worker: LearnerWorker) -> dict[str, torch.Tensor]:
    """Collective: the policy's frozen base tensors under their Hugging Face names."""
    out = {}
    for name, tensor in worker.policy.state_dict().items():
        if not lora.is_adapter(name):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            out[lora.checkpoint_name(name)] = full.detach().clone()
    return out


def run_lora_rank(
    rank: int, world_size: int, port: int, model_dir: str, out_dir: str, scenario: str,
    overrides: dict[str, Any],
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(out_dir)
    worker = procs.make_worker(model_dir, rank, world_size, port, {**LORA, **overrides})
    saved: dict[str, Any] = {}
    metrics = []
    try:
        first = 0
        if scenario == "resume":
            first = worker.load_checkpoint(latest_complete_checkpoint(out / "ckpt"))["next_step"]
        else:
            saved["adapters_init"] = dict(worker.named_adapter_tensors())
            saved["adapter_config"] = worker.adapter_config()
        for step in range(first, 4):
            batch = procs.make_batch(step) if rank == 0 else None
            metrics.append(worker.step(batch, policy_version=step))
            saved[f"adapters_step{step + 1}"] = dict(worker.named_adapter_tensors())
            saved[f"merged_step{step + 1}"] = procs.full_weights(worker)
            if scenario == "train" and step == 0:
                saved["probe"] = probe(worker, procs.make_batch(1) if rank == 0 else None)
            if scenario == "train" and step == 1:
                worker.save_checkpoint(out / "ckpt", {"next_step": 2})
        saved["base_end"] = base_weights(worker)
        if rank == 0:
            torch.save(saved, out / f"{scenario}.pt")
            (out / f"{scenario}_metrics.json").write_text(json.dumps(metrics))
    finally:
        worker.close()


def run_sp_lora(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    """One LoRA step with ``sequence_parallel = world_size``, then logprobs and adapters."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    overrides = {**LORA, "sequence_parallel": world_size, "num_ranks": world_size}
    worker = procs.make_worker(model_dir, rank, world_size, port, overrides)
    try:
        worker.step(procs.make_batch(0) if rank == 0 else None, policy_version=0)
        gb = GlobalBatch.from_arrow(procs.make_batch(1))
        plan = worker._plan(gb, np.arange(gb.size))
        saved = {
            "policy": worker._infer(worker.policy, gb, plan, values=False),
            "reference": worker._reference_logprobs(gb, plan),
            "adapters": dict(worker.named_adapter_tensors()),
        }
        if rank == 0:
            torch.save(saved, Path(out_dir) / f"sp{world_size}.pt")
    finally:
        worker.close()
