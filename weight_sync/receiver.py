"""Engine side of weight sync: join the learner's group, receive broadcasts, hand back tensors.

The engine's HTTP handlers (SGLang's endpoints) call, each in a worker thread:

    receiver = WeightReceiver(device="cpu")
    receiver.init_group(master_address, master_port, rank_offset, world_size,
                        group_name, backend)            # POST /init_weights_update_group
    named = receiver.receive(names, dtypes, shapes, group_name, load_format)
                                                         # POST /update_weights_from_distributed
    receiver.destroy(group_name)                         # POST /destroy_weights_update_group

``receive`` blocks on the learner's broadcast(s) and returns ``(name, tensor)``
pairs for the engine to load; it does not touch the model. Given ``load`` (a
callable taking those pairs), it receives into the group's reusable arena
(on CPU) instead of fresh memory and calls ``load`` before the next receive may reuse it
(an engine that copies the tensors into its model before replying, as both of
ours do): on CPU a fresh receive buffer costs a page fault per 4 KiB, more than
the broadcast itself (see ``buckets``). ``load_format``
None means one broadcast per tensor (SGLang's default); ``"flattened_bucket"``
means one broadcast of the tensors' concatenated bytes (see ``buckets``).

One receive per group at a time: the learner sends the next update only after
this one's reply, and a lock per group enforces it here as well.

Left out: loading into the model and version bookkeeping (the engine's job),
and several engine ranks per receiver (construct one receiver per rank, or pass
``local_rank``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from fleetrl.log import get_logger
from weight_sync.buckets import TensorMeta, metas_from_wire, unpack_bucket
from weight_sync.group import WeightGroup, connect_store, resolve_backend

log = get_logger(__name__)

LOAD_FORMATS = (None, "flattened_bucket")
# Per-tensor receives into the arena start each tensor at a multiple of this (any dtype's size).
_ALIGN = 64

Loaded = TypeVar("Loaded")


class ReceiveArena:
    """One growable ``uint8`` buffer that every receive of a group lands in.

    ``flat(nbytes)`` is a bucket's receive buffer; ``tensors(metas)`` are per-tensor
    receive buffers, each at an aligned offset. Both are views, valid until the next call.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)  # free first
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def flat(self, nbytes: int) -> torch.Tensor:
        return self._reserve(nbytes)[:nbytes]

    def tensors(self, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
        offsets, end = [], 0
        for meta in metas:
            offsets.append(end)
            end += -(-meta.nbytes // _ALIGN) * _ALIGN
        buffer = self._reserve(end)
        return [
            buffer[offset : offset + meta.nbytes].view(meta.dtype).reshape(meta.shape)
            for meta, offset in zip(metas, offsets, strict=True)
        ]


class WeightReceiver:
    """Holds this engine's weight-update groups by name."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._groups: dict[str, WeightGroup] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._arenas: dict[str, ReceiveArena] = {}
        self._registry_lock = threading.Lock()

    @property
    def group_names(self) -> list[str]:
        with self._registry_lock:
            return list(self._groups)

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 60,
        *,
        local_rank: int = 0,
    ) -> None:
        """Join the group as rank ``rank_offset + local_rank``; blocks until every rank has joined."""
        if not group_name:
            raise ValueError("init_weights_update_group: group_name must not be empty")
        with self._registry_lock:
            if group_name in self._groups:
                raise ValueError(
                    f"weight-update group {group_name!r} already exists on this engine; destroy it first"
                )
        backend = resolve_backend(backend, self.device)
        rank = int(rank_offset) + int(local_rank)
        started = time.monotonic()
        store = connect_store(master_address, master_port, timeout_s)
        group = WeightGroup(
            store,
            group_name=group_name,
            rank=rank,
            world_size=int(world_size),
            backend=backend,
            timeout_s=timeout_s,
            master_address=master_address,
            device=self.device,
            register=False,  # rank 0 may live in this process (see group._sglang_style_group)
        )
        with self._registry_lock:
            self._groups[group_name] = group
            self._locks[group_name] = threading.Lock()
            self._arenas[group_name] = ReceiveArena(self.device)
        log.info(
            "joined weight group %s as rank %d/%d (%s) in %.2fs",
            group_name,
            rank,
            world_size,
            backend,
            time.monotonic() - started,
        )

    def _group(self, group_name: str) -> tuple[WeightGroup, threading.Lock, ReceiveArena]:
        with self._registry_lock:
            if group_name not in self._groups:
                known = ", ".join(self._groups) or "none"
                raise ValueError(
                    f"weight-update group {group_name!r} is not initialised on this engine "
                    f"(known: {known}); call /init_weights_update_group first"
                )
            return self._groups[group_name], self._locks[group_name], self._arenas[group_name]

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
        load: Callable[[list[tuple[str, torch.Tensor]]], Loaded] | None = None,
    ) -> list[tuple[str, torch.Tensor]] | Loaded:
        """Receive one update from rank 0 (on this receiver's device).

        Without ``load``: returns the tensors, in fresh memory. With ``load``: receives
        into the group's arena, calls ``load(tensors)`` (the tensors are views valid only
        during the call) and returns what it returns.
        """
        if load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format {load_format!r} is not supported; accepted: None, 'flattened_bucket'"
            )
        metas = metas_from_wire(names, dtypes, shapes)
        group, lock, arena = self._group(group_name)
        # CPU only: fresh CPU memory page-faults; CUDA's caching allocator reuses anyway,
        # and an arena would pin the largest update's size on the GPU.
        reuse = load is not None and self.device.type == "cpu"
        with lock:
            deadline = time.monotonic() + group.timeout_s
            if load_format == "flattened_bucket":
                nbytes = sum(m.nbytes for m in metas)
                flat = (
                    arena.flat(nbytes)
                    if reuse
                    else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                )
                group.wait(
                    group.broadcast(flat), f"receive bucket of {len(metas)} tensors", deadline
                )
                named = unpack_bucket(flat, metas)
            else:
                tensors = (
                    arena.tensors(metas)
                    if reuse
                    else [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
                )
                works = [group.broadcast(t) for t in tensors]
                for meta, work in zip(metas, works, strict=True):
                    group.wait(work, f"receive {meta.name}", deadline)
                named = [(m.name, t) for m, t in zip(metas, tensors, strict=True)]
            return named if load is None else load(named)

    def destroy(self, group_name: str) -> None:
        """Leave and forget a group (an unknown name is a ValueError)."""
        with self._registry_lock:
            group = self._groups.pop(group_name, None)
            self._locks.pop(group_name, None)
            self._arenas.pop(group_name, None)
        if group is None:
            raise ValueError(
                f"weight-update group {group_name!r} is not initialised on this engine"
            )
        group.close(abort=True)
        log.info("left weight group %s", group_name)

    def close(self) -> None:
        """Leave every group (engine shutdown)."""
        for name in self.group_names:
            self.destroy(name)
