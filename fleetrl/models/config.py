"""Model section of the run config: which checkpoint the policy starts from."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class TinyModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Shape of the random-init model built when ``model.path`` does not exist and ``model.create_tiny`` is set."""

    arch: Annotated[
        Literal["qwen2", "llama"], Meta(description="Architecture family of the tiny model.")
    ] = "qwen2"
    layers: Annotated[int, Meta(ge=1, description="Transformer blocks.")] = 2
    hidden: Annotated[int, Meta(ge=8, description="Hidden size.")] = 64
    heads: Annotated[int, Meta(ge=1, description="Attention heads.")] = 4
    max_positions: Annotated[int, Meta(ge=16, description="Maximum sequence length.")] = 256
    seed: Annotated[int, Meta(description="Seed of the random init.")] = 0


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
    gradient_checkpointing: Annotated[
        bool, Meta(description="Recompute activations in the backward pass to save memory.")
    ] = False
