"""Optimizer state on the host between steps (``learner.optimizer_offload``), streamed
through the device for each step.

AdamW keeps two fp32 moments per trained parameter: 8 bytes, twice the fp32 weights and
as much as the weights and gradients together. ``OffloadedOptimizer`` keeps every state
tensor of its optimizer in host memory (pinned, on CUDA) between steps, so forward and
backward run without it, and ``step()`` updates the parameters chunk by chunk (chunks of
about ``chunk_bytes`` of state, in parameter order):

    copy stream:  H2D c0 | H2D c1        | D2H c0, H2D c2 | D2H c1, H2D c3 | ... D2H cN
    compute:             | update c0     | update c1      | update c2      | ...

chunk k+1's state comes to the device while chunk k is updated, and chunk k's goes back
while chunk k+1 is updated, so the device holds about three chunks of state at once
(``STAGED_CHUNKS``), never the whole of it, and the copies overlap the updates. Each
chunk is updated by the optimizer's own ``step`` (the other parameters' gradients are
set aside for the call), so the arithmetic is the optimizer's own, bit for bit. Step
counts (0-dim tensors) stay where the optimizer keeps them (the host).

On the CPU host and device are one memory: the same code path runs (chunking, the
set-aside gradients, the moves, which return the tensors themselves), so a CPU test
proves the path the GPU takes; the GPU check measures the device memory it frees
(bench/gpu/stages.py, ``optimizer_offload``). Checkpoints and the co-located onload go
through ``on_device()``, which brings the whole state back for the block.

With ``learner.param_offload`` FSDP keeps parameters, gradients and the optimizer state
on the host and steps there: this class is not used then.

Left out: stepping on the host (DeepSpeed's CPU Adam), which would also need the fp32
master weights there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

STAGED_CHUNKS = 3  # chunks of state on the device at once: arriving, updating, leaving


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what occupies memory); a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _moved(tensor: Any) -> bool:
    """Whether a state value travels: tensors but the 0-dim step counts."""
    return isinstance(tensor, torch.Tensor) and tensor.dim() > 0


def state_bytes(param: torch.Tensor) -> int:
    """AdamW's state of one parameter (two fp32 moments of its local shard)."""
    return 2 * 4 * _local(param).numel()


class OffloadedOptimizer:
    """An optimizer whose state lives on the host between steps (module docstring)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, device: torch.device | str, *, chunk_bytes: int
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        self.chunk_bytes = chunk_bytes
        on_cuda = self.device.type == "cuda"
        self._copy = torch.cuda.Stream(self.device) if on_cuda else None
        self.chunks_stepped = 0
        self.bytes_moved = 0

    # ---- what guarded_step calls ---------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Update every parameter with a gradient, its state streamed through the device."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]  # fmt: skip
        grads = {id(p): p.grad for p in params}
        chunks = self.chunks(params)
        try:
            arrived = self._fetch(chunks[0]) if chunks else None
            for index, chunk in enumerate(chunks):
                self._wait(arrived)
                if index + 1 < len(chunks):
                    arrived = self._fetch(chunks[index + 1])  # overlaps this chunk's update
                self._update(chunk, params, grads)
                self._store(chunk)  # overlaps the next chunk's update
            if self._copy is not None:
                self._copy.synchronize()  # the host copies are complete: anything may read them
        finally:
            for p in params:
                p.grad = grads[id(p)]

    # ---- where the state is --------------------------------------------------------------

    def chunks(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive parameters holding about ``chunk_bytes`` of state each (a larger
        parameter alone)."""
        out: list[list[torch.Tensor]] = []
        size = 0
        for p in params:
            if out and size + state_bytes(p) <= self.chunk_bytes:
                out[-1].append(p)
                size += state_bytes(p)
            else:
                out.append([p])
                size = state_bytes(p)
        return out

    def state_devices(self) -> set[torch.device]:
        """The devices the moved state tensors are on (the host's alone between steps)."""
        return {
            _local(v).device
            for state in self.optimizer.state.values()
            for v in state.values()
            if _moved(v)
        }

    def to_host(self) -> None:
        """Every state tensor to the host (after a load placed them on the device)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._store(params)
        if self._copy is not None:
            self._copy.synchronize()

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The whole state on the device for the block (a checkpoint), back on the host after."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._wait(self._fetch(params))
        try:
            yield
        finally:
            self.to_host()

    # ---- moves ---------------------------------------------------------------------------

    def _fetch(self, chunk: list[torch.Tensor]) -> torch.cuda.Event | None:
        """Start copying ``chunk``'s state to the device; the event the update waits for."""
        with self._on_copy_stream():
            for p in chunk:
                state = self.optimizer.state.get(p, {})
                for key, value in list(state.items()):
                    if _moved(value) and _local(value).device != self.device:
                        state[key] = value.to(self.device, non_blocking=True)
                        self.bytes_moved += _local(value).nbytes
                        if self._copy is not None:  # made on the copy stream, used on compute
                            _local(state[key]).record_stream(torch.cuda.current_stream(self.device))  # fmt: skip
            return self._copy.record_event() if self._copy is not None else None

    def _wait(self, arrived: torch.cuda.Event | None) -> None:
        if arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(arrived)

    def _update(self, chunk: list[torch.Tensor], params: list[torch.Tensor], grads: dict) -> None:
        """The optimizer's own step on ``chunk`` alone (the others' gradients set aside)."""
        mine = {id(p) for p in chunk}
        for p in params:
            p.grad = grads[id(p)] if id(p) in mine else None
        self.optimizer.step()
        self.chunks_stepped += 1

    def _store(self, chunk: list[torch.Tensor]) -> None:
        """Copy ``chunk``'s state to the host once its update is done (on the copy stream)."""
        updated = torch.cuda.current_stream(self.device).record_event() if self._copy else None
        with self._on_copy_stream():
            if updated is not None:
                self._copy.wait_event(updated)
            for p in chunk:
                state = self.optimizer.state.get(p, {})
                for key, value in list(state.items()):
                    if _moved(value) and _local(value).device != self.host:
                        if self._copy is not None:  # read on the copy stream before it is freed
                            _local(value).record_stream(self._copy)
                        state[key] = value.to(self.host, non_blocking=True)  # pinned on CUDA
                        self.bytes_moved += _local(value).nbytes

    @contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        if self._copy is None:
            yield
            return
        with torch.cuda.stream(self._copy):
            yield


def offload_for(
    optimizer: torch.optim.Optimizer, device: torch.device, *, enabled: bool, param_offload: bool,
    chunk_mb: int,
) -> OffloadedOptimizer | None:  # fmt: skip
    """``optimizer``'s offload under ``learner.optimizer_offload`` (None when off, or when
    FSDP's ``param_offload`` keeps the whole state on the host already: GPU runs)."""
    if not enabled or (param_offload and device.type == "cuda"):
        return None
    return OffloadedOptimizer(optimizer, device, chunk_bytes=chunk_mb * 2**20)


def offload_optimizers(
    optimizers: list[torch.optim.Optimizer | None], device: torch.device, cfg: Any
) -> dict[int, OffloadedOptimizer]:
    """The offloads of a learner's optimizers by ``id`` (``cfg``: its ``LearnerConfig``)."""
    out = {}
    for optimizer in optimizers:
        made = optimizer and offload_for(
            optimizer, device, enabled=cfg.optimizer_offload, param_offload=cfg.param_offload,
            chunk_mb=cfg.optimizer_offload_chunk_mb,
        )  # fmt: skip
        if made:
            out[id(optimizer)] = made
    return out


@contextmanager
def states_on_device(offloaded: list[OffloadedOptimizer | None]) -> Iterator[None]:
    """Every offloaded optimizer's state on the device for the block (checkpoints)."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        for item in offloaded:
            if item is not None:
                stack.enter_context(item.on_device())
        yield
