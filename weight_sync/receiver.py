"""Engine side of weight sync: join the learner's group, receive broadcasts, hand back tensors.

The engine's HTTP handlers (SGLang's endpoints) call, each in a worker thread:

    receiver = WeightReceiver(device="cpu")
    receiver.init_group(master_address, master_port, rank_offset, world_size,
                        group_name, backend)            # POST /init_weights_update_group
    named = receiver.receive(names, dtypes, shapes, group_name, load_format)
                                                         # POST /update_weights_from_distributed
    receiver.destroy(group_name)                         # POST /destroy_weights_update_group

``receive`` blocks on the learner's broadcast(s) and returns ``(name, tensor)``
pairs for the engine to load; it does not touch the model. ``load_format``
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
from collections.abc import Sequence

import torch

from fleetrl.log import get_logger
from weight_sync.buckets import metas_from_wire, unpack_bucket
from weight_sync.group import WeightGroup, connect_store, resolve_backend

log = get_logger(__name__)

LOAD_FORMATS = (None, "flattened_bucket")


class WeightReceiver:
    """Holds this engine's weight-update groups by name."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._groups: dict[str, WeightGroup] = {}
        self._locks: dict[str, threading.Lock] = {}
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
        log.info(
            "joined weight group %s as rank %d/%d (%s) in %.2fs",
            group_name,
            rank,
            world_size,
            backend,
            time.monotonic() - started,
        )

    def _group(self, group_name: str) -> tuple[WeightGroup, threading.Lock]:
        with self._registry_lock:
            if group_name not in self._groups:
                known = ", ".join(self._groups) or "none"
                raise ValueError(
                    f"weight-update group {group_name!r} is not initialised on this engine "
                    f"(known: {known}); call /init_weights_update_group first"
                )
            return self._groups[group_name], self._locks[group_name]

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one update from rank 0 and return its tensors (on this receiver's device)."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format {load_format!r} is not supported; accepted: None, 'flattened_bucket'"
            )
        metas = metas_from_wire(names, dtypes, shapes)
        group, lock = self._group(group_name)
        with lock:
            deadline = time.monotonic() + group.timeout_s
            if load_format == "flattened_bucket":
                flat = torch.empty(
                    sum(m.nbytes for m in metas), dtype=torch.uint8, device=self.device
                )
                group.wait(
                    group.broadcast(flat), f"receive bucket of {len(metas)} tensors", deadline
                )
                return unpack_bucket(flat, metas)
            tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
            works = [group.broadcast(t) for t in tensors]
            for meta, work in zip(metas, works, strict=True):
                group.wait(work, f"receive {meta.name}", deadline)
            return [(m.name, t) for m, t in zip(metas, tensors, strict=True)]

    def destroy(self, group_name: str) -> None:
        """Leave and forget a group (an unknown name is a ValueError)."""
        with self._registry_lock:
            group = self._groups.pop(group_name, None)
            self._locks.pop(group_name, None)
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
