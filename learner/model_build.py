"""Building one of the learner's models (policy, reference or critic) on this rank.

``build_model`` puts together what ``learner.sharded_load.build_sharded`` does
generically with the learner's choices for one role: gradient checkpointing
(training models only: transformers' per-block switch), the peft LoRA wrapper (the policy, or a reward model being
trained, whose ``score`` head then trains in full beside the adapters; base weights
come from the files under their Hugging Face names, adapters from the seed), FSDP2 sharding (``learner.fsdp.shard_model``: bf16 compute, CPU offload,
reshard after forward; a world of one rank in fp32 runs the plain module, ``uses_fsdp``),
the critic's freshly initialised ``score`` head (a value head on
the backbone of any family: ``learner.value_model``), and
Ulysses attention when the sequence is split (``learner.ulysses``, which needs
the attention and KV head counts divisible by the group size).
``init_value_head`` fills the critic's head from the seed, the same on every rank.

Optimizers and schedulers are built by ``LearnerWorker.setup`` (``learner.fsdp``).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from fleetrl.models.config_sizes import model_sizes
from learner import lora, ulysses
from learner.config import LoraConfig
from learner.fsdp import shard_model
from learner.sharded_load import ModelKind, build_sharded, fill_from_full, index_safetensors


def build_model(
    path: Path,
    kind: ModelKind,
    *,
    device: torch.device,
    train: bool,
    grad_checkpointing: bool,
    bf16: bool,
    offload: bool,
    reshard_after_forward: bool,
    lora_cfg: LoraConfig | None,
    seed: int,
    sp_size: int,
) -> nn.Module:
    """Meta init, FSDP2 sharding, then only this rank's shards read from the files.

    ``device``: where the model computes (its shards live on the CPU under
    ``offload``). ``grad_checkpointing`` applies to a ``train`` model only.
    ``lora_cfg``: the model is wrapped by peft before sharding; base weights come
    from the files, adapters from ``seed``. ``sp_size`` > 1: Ulysses attention.
    """
    lora_on = lora_cfg is not None

    def prepare(model: nn.Module) -> None:
        if train and grad_checkpointing:
            enable_activation_checkpointing(model)

    def shard(model: nn.Module) -> nn.Module:
        if not uses_fsdp(bf16=bf16, offload=offload, sp_size=sp_size):
            return model
        return shard_model(
            model, bf16=bf16, cpu_offload=offload, reshard_after_forward=reshard_after_forward
        )

    def skip_missing(name: str) -> bool:  # tensors the caller initialises
        if lora_on and lora.is_adapter(name):
            return True
        file_name = lora.checkpoint_name(name) if lora_on else name
        return kind != "causal_lm" and file_name.startswith("score.")

    # a reward model's head trains in full beside the adapters
    head = "score" if kind == "reward" else None

    model = build_sharded(
        path,
        kind=kind,
        device=torch.device("cpu") if offload else device,
        shard=shard,
        prepare=prepare,
        wrap=(lambda m: lora.wrap(m, lora_cfg, path, trained_head=head))
        if lora_on
        else (lambda m: m),
        skip_missing=skip_missing,
        file_name=lora.checkpoint_name if lora_on else (lambda name: name),
    )
    if lora_on:
        lora.init_adapters(model, seed)
    if sp_size > 1:
        sizes = model_sizes(model.config)
        heads, kv_heads = sizes.heads, sizes.kv_heads
        if heads % sp_size or kv_heads % sp_size:
            raise ValueError(
                f"learner.sequence_parallel={sp_size} must divide the model's "
                f"{heads} attention and {kv_heads} KV heads"
            )
        ulysses.install(model)
    model.train(train)
    return model


def uses_fsdp(*, bf16: bool, offload: bool, sp_size: int) -> bool:
    """Whether the model is wrapped by FSDP2: always, except on a world of one rank that
    computes in fp32 with its parameters on its device (the CPU demo's learner).

    There FSDP2 shards nothing and reduces nothing, yet every step pays for it: DTensor
    dispatch in the optimizer and the gradient clip, hooks around every block's forward
    and backward (measured at the demo's size: 125 ms a step wrapped, 105 ms plain).
    FSDP2 stays where it does something even on one rank: bf16 compute over fp32 master
    weights (its ``MixedPrecisionPolicy``), CPU offload, and the sequence-parallel group.
    Checkpoints are DCP's either way, so one written plain loads sharded and back.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    return world > 1 or bf16 or offload or sp_size > 1


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block's activations in backward (transformers' own switch, which
    wraps the family's ``GradientCheckpointingLayer`` blocks); a model without one is refused."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing: set "
            "learner.grad_checkpointing=false and model.gradient_checkpointing=false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name (the old warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def stored_head(path: Path) -> set[str]:
    """Which of the ``score`` head's tensors ("weight", "bias") the folder's files hold."""
    return {n.removeprefix("score.") for n in index_safetensors(path) if n.startswith("score.")}


def init_value_head(
    critic: nn.Module, seed: int, std: float, *, keep: Collection[str] = ()
) -> None:
    """The head from the seed (the same full tensor on every rank; each keeps its shard):
    weight ~ N(0, std²), bias 0; the tensors named in ``keep`` were read from the model
    folder (``stored_head``: a reward model's head) and are left as they are."""
    generator = torch.Generator().manual_seed(seed)
    weight = critic.score.weight
    if "weight" not in keep:
        fill_from_full(weight, torch.randn(weight.shape, generator=generator) * std)
    if critic.score.bias is not None and "bias" not in keep:
        fill_from_full(critic.score.bias, torch.zeros(critic.score.bias.shape))
