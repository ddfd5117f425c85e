"""What fleetrl needs to know about a causal LM's layout, read from the model itself.

Families lay out the same parts differently: Llama and Qwen2 keep their blocks in
``model.layers`` and their projections in ``q_proj``/``k_proj``/``v_proj``;
GPT-2 in ``transformer.h`` with fused ``c_attn`` ``Conv1D`` layers; GPT-NeoX in
``gpt_neox.layers`` with ``query_key_value``; OPT in ``model.decoder.layers``;
Phi's MLP is ``fc1``/``fc2``. Nothing here names one of them:

- ``decoder_blocks``: the repeated blocks to shard with FSDP2 and to checkpoint,
  found as the modules whose class the model lists in ``_no_split_modules`` (the
  classes transformers itself never splits across devices; FSDP auto-wrapping in
  verl, torchtitan and TRL keys on the same list);
- ``backbone``: the module the files name ``<base_model_prefix>.*`` (what a value
  head sits on: ``learner.value_model``);
- ``block_linear_names``: the linear layers of the blocks (``nn.Linear`` and
  transformers' ``Conv1D``), what LoRA can target; ``lora_target_problem`` says
  in one line when ``learner.lora.target_modules`` matches none of them;
- ``architecture_problem``: why a config cannot be trained as a causal LM here
  (an encoder–decoder, no causal LM in transformers for its ``model_type``, a
  folder holding a classifier, no decoder blocks), or None.

A peft wrapper (LoRA) is looked through everywhere.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# peft's suffix: the module names a LoRA target list matches against
ALL_LINEAR = "all-linear"
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose class is in the model's ``_no_split_modules``, in order.

    Raises ValueError when the model lists none or none is found (nothing to shard per block).
    """
    base = unwrap(model)
    classes = set(getattr(base, "_no_split_modules", None) or ())
    if not classes:
        raise ValueError(
            f"{type(base).__name__} lists no _no_split_modules: its decoder blocks cannot be "
            "found to shard and checkpoint"
        )
    blocks: list[nn.Module] = []
    inside: list[str] = []  # names of the blocks found: their submodules are not blocks again
    for name, module in base.named_modules():
        if module is base or any(name.startswith(prefix + ".") for prefix in inside):
            continue
        # by any class of its MRO: FSDP2 makes a block an ``FSDP<Class>`` subclass
        if any(cls.__name__ in classes for cls in type(module).__mro__):
            blocks.append(module)
            inside.append(name)
    if not blocks:
        raise ValueError(
            f"{type(base).__name__} has no module of its _no_split_modules {sorted(classes)}"
        )
    return blocks


def backbone(model: nn.Module) -> nn.Module:
    """The model's base (``<base_model_prefix>``): the blocks without the LM head."""
    base = unwrap(model)
    return getattr(base, base.base_model_prefix)


def backbone_prefix(config: Any) -> str:
    """The name the files give the backbone's tensors (``model``, ``transformer``, ``gpt_neox``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].base_model_prefix


def _is_linear(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, nn.Linear | Conv1D)


def block_linears(block: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) features of every linear layer of one block, by its name inside the block."""
    from transformers.pytorch_utils import Conv1D

    out = {}
    for name, module in block.named_modules():
        if isinstance(module, Conv1D):  # weight [in, out]
            out[name] = (int(module.weight.shape[0]), int(module.nf))
        elif isinstance(module, nn.Linear):
            out[name] = (module.in_features, module.out_features)
    return out


def _linear_paths(model: nn.Module) -> list[str]:
    """The name inside its block of every linear layer of the decoder blocks."""
    return [
        name
        for block in decoder_blocks(model)
        for name, module in block.named_modules()
        if name and _is_linear(module)
    ]


def block_linear_names(model: nn.Module) -> list[str]:
    """The last dotted part of every linear layer in the decoder blocks, sorted (what a LoRA
    ``target_modules`` entry matches)."""
    return sorted({name.rsplit(".", 1)[-1] for name in _linear_paths(model)})


def peft_default_targets(model_type: str) -> list[str] | None:
    """peft's own LoRA targets for a family (None when peft has none)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return list(targets) if targets else None


def lora_target_problem(model: nn.Module, target_modules: list[str]) -> str | None:
    """Why ``target_modules`` would give this model no adapter (or None): each entry is
    matched as peft does, by the last dotted part(s) of a module name."""
    if target_modules == [ALL_LINEAR]:
        return None
    paths = _linear_paths(model)
    missing = [t for t in target_modules if not any(p == t or p.endswith("." + t) for p in paths)]
    if not missing:
        return None
    model_type = getattr(unwrap(model).config, "model_type", "")
    default = peft_default_targets(model_type)
    hint = f"; peft's default for {model_type}: {default}" if default else ""
    return (
        f"{missing} name no linear layer of {model_type}'s blocks (its linear layers: "
        f"{block_linear_names(model)}{hint}; or [{ALL_LINEAR}])"
    )


def causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def architecture_problem(config: Any) -> str | None:
    """Why a transformers config is not a decoder-only causal LM fleetrl can train, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        return f"an encoder-decoder model ({model_type}): fleetrl trains decoder-only causal LMs"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"transformers has no causal LM for model_type {model_type!r} "
            "(fleetrl runs no remote code)"
        )
    declared = list(getattr(config, "architectures", None) or [])
    if declared and not any(
        a in causal_lm_class_names() or a.endswith(_CAUSAL_LM_SUFFIXES) for a in declared
    ):
        return (
            f"its weights are a {declared[0]}, not a causal LM: the LM head would start random "
            "(give the folder of the causal LM it came from)"
        )
    return None
