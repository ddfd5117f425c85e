"""Process body for the sharded-loading test: load, measure RSS growth, dump full weights.

Each rank resets its peak-RSS counter (``/proc/self/clear_refs``: 5) right
before the load, so ``VmHWM`` after it is the peak during the load alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from learner import dist as ldist
from learner.fsdp import shard_model
from learner.sharded_load import build_sharded, meta_model


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def load_rank(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    ldist.init_group(
        master_addr="127.0.0.1", master_port=port, rank=rank, world_size=world_size, device=device
    )
    try:
        meta_model(
            model_dir, "causal_lm"
        )  # imports transformers' modelling code: not the load's cost
        Path("/proc/self/clear_refs").write_text("5")
        before_kb = _status_kb("VmRSS")
        model = build_sharded(
            model_dir,
            kind="causal_lm",
            device=device,
            shard=lambda m: shard_model(m, bf16=False, cpu_offload=False),
        )
        peak_kb = _status_kb("VmHWM")
        shard_bytes = sum(
            t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
            for t in model.state_dict().values()
        )
        figures = {
            "rank": rank,
            "world_size": world_size,
            "rss_growth_mb": (peak_kb - before_kb) / 1024,
            "shard_mb": shard_bytes / 2**20,
        }
        (Path(out_dir) / f"rss_{world_size}_{rank}.json").write_text(json.dumps(figures))
        full = {
            n: t.full_tensor() if hasattr(t, "full_tensor") else t
            for n, t in model.state_dict().items()
        }
        full |= {f"buffer:{n}": b for n, b in model.named_buffers()}
        if rank == 0:
            torch.save(full, Path(out_dir) / f"weights_{world_size}.pt")
    finally:
        ldist.close_group()
