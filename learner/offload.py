"""Moving a learner rank's state off its GPU while a co-located engine generates, and back.

In a co-located run (``rollout.placement: colocated``) the engine and learner rank i take
turns on one device. While the engine generates, the rank holds nothing it does not
need there: ``offload`` moves every model it built (policy, reference, critic: FSDP2
modules, whose ``_apply`` re-points their sharded parameters) and every optimizer's
state to host memory and empties CUDA's cache; ``onload`` brings them back before the
next step or anything else that reads them (a publish, a checkpoint, a snapshot).
Gradients are not moved: the step sets them to None after each update.

On CPU there is nothing to move (the host is the device): both calls return at once
and report 0 s. Neither does anything for models already kept on the host by
``learner.param_offload`` (FSDP's CPU offload) or ``rollout.colocate.offload_learner``
off.

Left out: pinned host buffers (moves use pageable memory), overlapping the onload with
the engine's release.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fleetrl.log import get_logger

log = get_logger(__name__)


def _optimizer_state_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=True)


class DeviceResidency:
    """Where a rank's models and optimizer state are (its device or the host), and moving them."""

    def __init__(
        self,
        device: torch.device,
        models: Iterable[nn.Module],
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        enabled: bool,
    ) -> None:
        self.device = device
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.enabled = enabled and device.type == "cuda"
        self.models_on_host = False
        self.optimizers_on_host = False

    @property
    def offloaded(self) -> bool:
        return self.models_on_host or self.optimizers_on_host

    def offload(self) -> float:
        """Everything to host memory; the seconds it took (0 when there is nothing to move)."""
        if not self.enabled or (self.models_on_host and self.optimizers_on_host):
            return 0.0
        started = time.perf_counter()
        self._move(torch.device("cpu"), models=True, optimizers=True)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.models_on_host = self.optimizers_on_host = True
        return time.perf_counter() - started

    def onload(self, *, optimizers: bool = True) -> float:
        """The models (and with ``optimizers`` their optimizer state) back on the device; the
        seconds it took. A push needs the weights only: its optimizers stay on the host."""
        move_optimizers = optimizers and self.optimizers_on_host
        if not (self.models_on_host or move_optimizers):
            return 0.0
        started = time.perf_counter()
        self._move(self.device, models=self.models_on_host, optimizers=move_optimizers)
        torch.cuda.synchronize(self.device)
        self.models_on_host = False
        self.optimizers_on_host = self.optimizers_on_host and not move_optimizers
        return time.perf_counter() - started

    @contextmanager
    def resident(self) -> Iterator[None]:
        """On the device for the block; offloaded again after it if it was before."""
        was_offloaded = self.offloaded
        self.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()

    def _move(self, device: torch.device, *, models: bool, optimizers: bool) -> None:
        with torch.no_grad():
            for model in self.models if models else []:
                model.to(device)
            for optimizer in self.optimizers if optimizers else []:
                _optimizer_state_to(optimizer, device)


def residency_for(worker, *, enabled: bool) -> DeviceResidency:
    """The residency of a set-up ``learner.worker.LearnerWorker``: its models and optimizers,
    but those already kept on the host (FSDP's ``learner.param_offload``,
    ``learner.reference.param_offload``; ``learner.optimizer_offload``)."""
    cfg = worker.cfg
    models, optimizers = [], []
    if not cfg.param_offload:
        models.append(worker.policy)
        optimizers.append(worker.optimizer)
        if worker.critic is not None:
            models.append(worker.critic)
            optimizers.append(worker.critic_optimizer)
    # learner.optimizer_offload keeps those on the host between steps already
    optimizers = [o for o in optimizers if id(o) not in worker.offloaded]
    if worker.reference is not None and not cfg.reference.param_offload:
        models.append(worker.reference)
    return DeviceResidency(worker.device, models, optimizers, enabled=enabled)
