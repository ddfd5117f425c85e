"""FSDP2 wrapping of a Hugging Face causal LM, and its optimizer, schedule and clipping.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to every
decoder block and then to the root (embeddings, final norm, LM/value head), the
layout torchtitan and verl's FSDP2 path use: one all-gather per block in forward
and one reduce-scatter per block in backward. The blocks are the model's own
``_no_split_modules`` (``fleetrl.models.family.decoder_blocks``: ``model.layers``
in Llama, ``transformer.h`` in GPT-2, ``gpt_neox.layers``, ``model.decoder.layers``
in OPT, ...).
Parameters stay fp32 (the master copy); on GPU a ``MixedPrecisionPolicy``
computes in bf16 and reduces gradients in fp32. On CPU (gloo) everything is
fp32. ``CPUOffloadPolicy`` keeps parameters, gradients and optimizer state on
the host (GPU only; on CPU it is already there).

Gradient averaging: FSDP2 divides reduced gradients by the world size. The
learner's losses are normalised by *global* counts and multiplied by the world
size (``masked_ops.agg_loss(dp_size=...)``), so the averaged gradient is the
exact gradient of the global mean.

Left out: HSDP (replicate × shard meshes), tensor parallelism, float8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from fleetrl.models.family import decoder_blocks
from learner.config import OptimConfig
from learner.dist import all_reduce_sum


def shard_model(
    model: nn.Module,
    *,
    bf16: bool,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Wrap ``model`` in place with FSDP2 (per block, then the root) and return it."""
    kwargs: dict = {"reshard_after_forward": reshard_after_forward}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,  # DTensor params of mixed placements; the loop is cheap next to the model
    )


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """``warmup_steps``, or ``warmup_ratio`` of the schedule's steps when that is 0 (verl's rule)."""
    if cfg.warmup_steps:
        return cfg.warmup_steps
    return int(cfg.warmup_ratio * (cfg.total_steps or total_steps))


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warm-up, then constant or cosine."""
    warmup = warmup_steps(cfg, total_steps)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, (cfg.total_steps or total_steps) - warmup)
    progress = min(1.0, (step - warmup) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )


class GuardedStep(NamedTuple):
    stepped: bool  # False: the loss or the gradient norm was not finite, nothing changed
    grad_norm: float  # the global pre-clip norm
    global_loss: float  # the local losses summed over the group


def guarded_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, local_loss: torch.Tensor
) -> GuardedStep:
    """Collective: clip and step, or skip when the global loss or the gradient norm is not
    finite; the gradients are zeroed either way.

    The global loss and the gradient norm are the same on every rank, so every rank
    takes the same decision.
    """
    global_loss = float(all_reduce_sum(local_loss.clone()))
    grad_norm = clip_grad_norm(list(model.parameters()), max_norm)
    stepped = math.isfinite(global_loss) and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return GuardedStep(stepped, grad_norm, global_loss)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip in place; return the global pre-clip norm (the same value on every rank).

    Non-finite norms are returned as-is (the caller skips the step) and the
    gradients are left unscaled.
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in grads], foreach=False)
    # A DTensor norm (FSDP2 grads) is already reduced over the group; full_tensor() reads it.
    norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(norm_value):
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=False)
    return norm_value
