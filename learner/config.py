"""Learner section of the run config: group, optimizer, algorithm, corrections, batching."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class OptimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lr: Annotated[float, Meta(gt=0, description="AdamW learning rate.")] = 1e-6
    weight_decay: Annotated[float, Meta(ge=0, description="AdamW weight decay.")] = 0.01
    betas: Annotated[tuple[float, float], Meta(description="AdamW betas.")] = (0.9, 0.999)
    eps: Annotated[float, Meta(gt=0, description="AdamW epsilon.")] = 1e-8
    warmup_steps: Annotated[int, Meta(ge=0, description="Linear warm-up steps.")] = 0
    schedule: Annotated[
        Literal["constant", "cosine"], Meta(description="LR schedule after warm-up.")
    ] = "constant"
    min_lr_ratio: Annotated[
        float, Meta(ge=0, le=1, description="Cosine floor as a fraction of lr.")
    ] = 0.0
    grad_clip: Annotated[float, Meta(gt=0, description="Max global gradient norm.")] = 1.0


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    num_ranks: Annotated[
        int,
        Meta(
            ge=1,
            description="FSDP ranks in the learner group (independent of the number of engines).",
        ),
    ] = 1
    cpus_per_rank: Annotated[float, Meta(ge=0, description="Ray CPUs per learner rank.")] = 1.0
    gpus_per_rank: Annotated[float, Meta(ge=0, description="Ray GPUs per learner rank.")] = 0.0
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
