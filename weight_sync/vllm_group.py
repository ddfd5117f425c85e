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

from typing import Any

import torch
import torch.distributed as dist

from fleetrl.log import get_logger
from weight_sync.group import (
    BroadcastGroup,
    GroupError,
    broadcast_options,
    gloo_backend,
    poll_until_done,
)

log = get_logger(__name__)

GLOO_PREFIX = "fleetrl-vllm-gloo/"
_POLL_S = 0.001


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """The gloo process group both sides build on the group's store (CPU runs and tests)."""
    return gloo_backend(dist.PrefixStore(GLOO_PREFIX, store), rank, world_size, timeout_s)


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


class VllmWeightGroup(BroadcastGroup):
    """Rank 0 (the learner) of a vLLM weight-transfer group; ``WeightGroup``'s surface."""

    def _connect(self, register: bool) -> None:
        """vLLM's PyNccl communicator on the store (nccl), or the gloo group (CPU)."""
        self._comm: Any = None
        self._pg: Any = None
        if self.backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            stateless = StatelessProcessGroup(
                rank=self.rank, world_size=self.world_size, store=self._store
            )
            self._comm = PyNcclCommunicator(stateless, device=self.device)
            if self._comm.disabled:
                raise GroupError("vLLM's PyNccl communicator is disabled on this device")
        else:
            self._pg = gloo_group(self._store, self.rank, self.world_size, self.timeout_s)

    def broadcast(self, flat: torch.Tensor, src: int = 0) -> Any:
        """Start broadcasting ``flat`` (as bytes) from ``src``; returns its work."""
        if self.closed:
            raise GroupError(f"group {self.group_name} is closed")
        data = flat if flat.dtype == torch.uint8 else flat.contiguous().view(-1).view(torch.uint8)
        if self._pg is not None:
            return self._pg.broadcast([data], broadcast_options(src, self.timeout_s))
        stream = torch.cuda.current_stream(self.device)
        self._comm.broadcast(data, src=src, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return _EnqueuedWork(event)

    def _until_done(self, work: Any, deadline: float) -> bool:
        """Poll the work (gloo's, or the enqueued PyNccl broadcast's event)."""
        return poll_until_done(work, deadline, _POLL_S)

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
