"""Model section of the run config: which checkpoint the policy starts from."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

# the families a tiny model is built in (``fleetrl model tiny --family``): block layouts that differ
TinyFamily = Literal["qwen2", "llama", "gpt2", "gpt_neox", "opt", "phi", "gemma"]
TINY_FAMILIES: tuple[str, ...] = get_args(TinyFamily)


class TinyModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Shape of the random-init model built when ``model.path`` does not exist and ``model.create_tiny`` is set."""

    arch: Annotated[
        TinyFamily,
        Meta(
            description="Model family of the tiny model: its block layout, and a tokenizer in the family's style (`fleetrl model tiny --family`)."
        ),
    ] = "qwen2"
    layers: Annotated[int, Meta(ge=1, description="Transformer blocks.")] = 2
    hidden: Annotated[int, Meta(ge=8, description="Hidden size.")] = 64
    heads: Annotated[int, Meta(ge=1, description="Attention heads.")] = 4
    max_positions: Annotated[int, Meta(ge=16, description="Maximum sequence length.")] = 256
    seed: Annotated[int, Meta(description="Seed of the random init.")] = 0


class WarmStartConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    steps: Annotated[
        int, Meta(ge=0, description="Supervised steps before RL (0 = no warm start).")
    ] = 0
    lr: Annotated[float, Meta(gt=0, description="Warm-start AdamW learning rate.")] = 1e-3
    batch_size: Annotated[int, Meta(ge=1, description="Examples per warm-start step.")] = 32
    label_noise: Annotated[
        float,
        Meta(
            ge=0,
            le=1,
            description="Fraction of answers replaced by a wrong one (integer answers become answer+1), so that RL has something to fix.",
        ),
    ] = 0.0
    seed: Annotated[int, Meta(description="Seed of example order and label noise.")] = 0


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: Annotated[
        str,
        Meta(
            description="Local Hugging Face model folder of the initial policy (nothing is downloaded)."
        ),
    ] = "runs/tiny-model"
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        Meta(
            description="Parameter dtype for the engines and the learner's compute (FSDP2 keeps fp32 master weights and reduces in fp32)."
        ),
    ] = "float32"
    create_tiny: Annotated[
        bool,
        Meta(
            description="If `path` is missing, build a tiny random-init model there (CPU demo and tests)."
        ),
    ] = False
    tiny: Annotated[TinyModelSpec, Meta(description="Shape of that tiny model.")] = msgspec.field(
        default_factory=TinyModelSpec
    )
    warmstart: Annotated[
        WarmStartConfig,
        Meta(
            description="Supervised warm start applied when the tiny model is built (see learner.sft)."
        ),
    ] = msgspec.field(default_factory=WarmStartConfig)
    gradient_checkpointing: Annotated[
        bool, Meta(description="Recompute activations in the backward pass to save memory.")
    ] = False
