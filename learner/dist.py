"""The learner group's process group: init from an explicit rendezvous, and the few
collectives the learner needs beyond FSDP's own.

Ranks meet at ``master_addr:master_port`` through a ``TCPStore`` that rank 0
hosts (no environment variables, so the Ray wrapper, ``torch.multiprocessing``
tests and a hand-started process all init the same way). Backend: gloo on CPU,
nccl on CUDA. ``broadcast_bytes`` moves an opaque byte string (Arrow IPC) from
rank 0 as a uint8 tensor: no pickle crosses the group; ``broadcast_record_batch`` sends a
whole Arrow batch that way (every learner step's batch). ``MetricSums`` reduces a
step's weighted metrics over the ranks in one all-reduce.

FSDP shards over the one flat group; sequence-parallel subgroups are formed by
``learner.ulysses``. Left out: tensor-parallel and HSDP meshes.
"""

from __future__ import annotations

from datetime import timedelta

import pyarrow as pa
import torch
import torch.distributed as dist

from buffer.arrow_batch import from_ipc, to_ipc
from fleetrl.log import get_logger

log = get_logger(__name__)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` alone means the current CUDA device (torch's
    ``init_process_group(device_id=...)`` refuses a device without an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def init_group(
    *,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = 1800.0,
) -> None:
    """Join (rank 0: host) the learner group. Raises ValueError on inconsistent arguments."""
    if not 0 <= rank < world_size:
        raise ValueError(f"learner rank {rank} is outside world_size {world_size}")
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists in this process; call close_group() first"
        )
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    backend = backend_for(device)
    kwargs = {"device_id": indexed(device)} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
    log.info(
        "learner rank %d/%d joined %s:%d (%s)", rank, world_size, master_addr, master_port, backend
    )


CLOSE_BARRIER_S = 10.0


def close_group() -> None:
    """Leave the learner group together: a barrier first (bounded: a dead peer does not hold
    us), so no rank tears down its transport while a peer still talks to it (gloo aborts the
    process when a pair's peer vanishes mid-use), then destroy."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=CLOSE_BARRIER_S))
    except RuntimeError as err:  # a peer died or timed out: leave anyway
        log.warning("learner group barrier before close failed: %s", err)
    dist.destroy_process_group()


def broadcast_bytes(payload: bytes | None, device: torch.device, src: int = 0) -> bytes:
    """Rank ``src`` passes bytes, the others None; every rank returns the bytes."""
    rank = dist.get_rank()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == src:
        if payload is None:
            raise ValueError(f"broadcast_bytes: rank {src} must pass the payload")
        size[0] = len(payload)
    dist.broadcast(size, src=src)
    n = int(size.item())
    if rank == src:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        dist.broadcast(buf, src=src)
    return payload if rank == src else bytes(buf.cpu().numpy())


def broadcast_record_batch(
    batch: pa.RecordBatch | None, *, rank: int, world_size: int, device: torch.device
) -> pa.RecordBatch:
    """Rank 0's Arrow batch on every rank (its IPC bytes broadcast; one rank: as given)."""
    if world_size == 1:
        if batch is None:
            raise ValueError("the learner step: rank 0 must pass the batch")
        return batch
    payload = broadcast_bytes(to_ipc(batch) if rank == 0 and batch is not None else None, device)
    return batch if rank == 0 else from_ipc(payload)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """In-place sum over the group (a no-op with one rank); returns the tensor."""
    if dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class MetricSums:
    """Weighted sums reduced over ranks in one all-reduce: value = Σ num / Σ den."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, key: str, value: float, weight: float) -> None:
        entry = self.sums.setdefault(key, [0.0, 0.0])
        entry[0] += value * weight
        entry[1] += weight

    def reduce(self, device: torch.device) -> dict[str, float]:
        keys = sorted(self.sums)
        if not keys:
            return {}
        flat = torch.tensor([v for k in keys for v in self.sums[k]], dtype=torch.float64)
        flat = all_reduce_sum(flat.to(device)).cpu()
        return {
            k: float(flat[2 * i] / flat[2 * i + 1]) if flat[2 * i + 1] else 0.0
            for i, k in enumerate(keys)
        }
