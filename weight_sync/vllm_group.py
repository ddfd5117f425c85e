"""Rank 0 of vLLM 0.34's trainer-to-worker weight-transfer group.

vLLM's workers join with ``StatelessProcessGroup.create(host, port, rank, world_size)`` (a
TCPStore client on the trainer's store) and then build the data plane on that store:
``PyNcclCommunicator`` (``vllm/distributed/weight_transfer/nccl_common.py``; rank 0 puts
NCCL's unique id under the store's ``broadcast_from/0/0`` key). The learner's side here
wraps the sender's own store (``group.MasterStore``) in vLLM's ``StatelessProcessGroup``
and builds the same communicator, so the two meet on the same keys; this needs vLLM
importable on the learner (as vLLM's own ``NCCLTrainerWeightTransferEngine`` does).

On the CPU (``backend == "gloo"``) vLLM has no communicator at all: the group is a gloo
process group on the same store under ``GLOO_PREFIX``, and the conformance tier's vLLM
workers (tests/conformance/vllm) build their half with ``gloo_group`` where vLLM would
build ``PyNcclCommunicator``; everything around it (vLLM's store rendezvous, its routes,
its payload dataclasses, its packed-chunk receive) is vLLM's own code.

Every broadcast is of bytes: a flat ``uint8`` bucket is one vLLM packed chunk (vLLM's
consumer cuts chunks from the request's metadata with the sender's
``packed_buffer_size_bytes``, which is the bucket size, so one request is one chunk).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fleetrl.log import get_logger
from weight_sync.group import GroupError

log = get_logger(__name__)

GLOO_PREFIX = "fleetrl-vllm-gloo/"
_POLL_S = 0.001


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """The gloo process group both sides build on the group's store (CPU runs and tests)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store), rank, world_size, options)


class _EnqueuedWork:
    """A PyNccl broadcast enqueued on the current stream: done once its event is."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self._future: torch.futures.Future = torch.futures.Future()

    def is_completed(self) -> bool:
        done = bool(self.event.query())
        if done and not self._future.done():
            self._future.set_result(None)
        return done

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self) -> bool:
        self.event.synchronize()
        self.is_completed()
        return True


class VllmWeightGroup:
    """Rank 0 (the learner) of a vLLM weight-transfer group; ``WeightGroup``'s surface."""

    def __init__(
        self,
        store: dist.Store,
        *,
        group_name: str,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        master_address: str,
        device: str | torch.device = "cpu",
        register: bool = True,
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device)
        self._store = store
        self._comm: Any = None
        self._pg: Any = None
        if backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            stateless = StatelessProcessGroup(rank=rank, world_size=world_size, store=store)
            self._comm = PyNcclCommunicator(stateless, device=self.device)
            if self._comm.disabled:
                raise GroupError("vLLM's PyNccl communicator is disabled on this device")
        elif backend == "gloo":
            self._pg = gloo_group(store, rank, world_size, self.timeout_s)
        else:
            raise ValueError(f"unsupported weight-sync backend {backend!r}")
        self.closed = False

    def broadcast(self, flat: torch.Tensor, src: int = 0) -> Any:
        """Start broadcasting ``flat`` (as bytes) from ``src``; returns its work."""
        if self.closed:
            raise GroupError(f"group {self.group_name} is closed")
        data = flat if flat.dtype == torch.uint8 else flat.contiguous().view(-1).view(torch.uint8)
        if self._pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.timeout = timedelta(seconds=self.timeout_s)
            return self._pg.broadcast([data], opts)
        stream = torch.cuda.current_stream(self.device)
        self._comm.broadcast(data, src=src, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return _EnqueuedWork(event)

    def wait(self, work: Any, what: str, deadline: float | None = None) -> None:
        """Block until ``work`` is done; GroupError on failure or past ``deadline``."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        try:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise GroupError(f"{what}: no completion within {self.timeout_s:.1f}s")
                time.sleep(_POLL_S)
            work.wait()
        except RuntimeError as err:
            if isinstance(err, GroupError):
                raise
            raise GroupError(f"{what} failed in group {self.group_name}: {err}") from err

    def close(self, *, abort: bool = False) -> None:
        """Leave the group; ``abort`` drops in-flight collectives."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._pg is not None and abort and hasattr(self._pg, "abort"):
                self._pg.abort()
            if self._comm is not None:
                self._comm.destroy()
        except RuntimeError as err:
            log.warning("closing vLLM weight group %s: %s", self.group_name, err)
        self._pg = self._comm = None
        self._store = None  # type: ignore[assignment]
