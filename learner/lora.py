"""LoRA on the policy through peft: wrapping, file names, adapter init, adapter and merged weights.

With ``learner.lora.rank`` > 0 the policy is a ``peft.PeftModelForCausalLM``
around the Hugging Face model, built on the meta device before FSDP2 sharding
(``wrap``): peft freezes every base weight and adds ``lora_A``/``lora_B`` to
the targeted linear layers; only those reach the optimizer. The base weights
are then read from the model folder under their Hugging Face names
(``checkpoint_name`` undoes peft's renaming) and the adapters are initialised
from the seed (``init_adapters``: A as peft draws it, B zero, so the wrapped
model starts equal to the base). The reference policy is the same model inside
``disable_adapter()``: no second copy.

Weights out (collectives: every rank iterates, ``full_tensor`` all-gathers):

- ``named_adapter_tensors``: the adapters in peft's *saved* naming, the keys of
  ``get_peft_model_state_dict`` (what ``save_pretrained`` writes to
  ``adapter_model.safetensors``), on the CPU — the LoRA weight sync.
- ``merged_weight`` (used by ``learner.weights_out.named_full_tensors``): a base
  weight with its adapter folded in (W + scaling·B·A), under its Hugging Face
  name, so a full sync still gives an engine the trained policy.

``adapter_config`` is the ``adapter_config.json`` an engine needs to load the
adapters (``target_modules`` as peft resolved them: "all-linear" becomes the
full module paths). A checkpoint holds the adapters and their optimizer state,
not the frozen base (``LearnerWorker`` re-reads it from the model folder).

Left out: DoRA, rsLoRA, adapters on embeddings or the LM head, several adapters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learner.config import LoraConfig
from learner.sharded_load import fill_from_full

ADAPTER_NAME = "default"  # peft's name of the single adapter
_WRAPPER_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model
_BASE_LAYER = ".base_layer"
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def peft_config(
    cfg: LoraConfig, base_model_path: str | Path, *, trained_head: str | None = None
) -> Any:
    """The ``peft.LoraConfig`` of ``cfg`` (``["all-linear"]`` becomes peft's "all-linear").

    ``trained_head``: a head that gets no adapter (it trains in full: a reward model's
    ``score``); the model is then no causal LM and peft's generic wrapper is used.
    """
    import peft

    if cfg.rank <= 0:
        raise ValueError("learner.lora.rank must be > 0 to build a LoRA adapter")
    targets: str | list[str] = (
        "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    )
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM" if trained_head is None else None,
        exclude_modules=None if trained_head is None else [trained_head],
        base_model_name_or_path=str(base_model_path),
    )


def wrap(
    model: nn.Module,
    cfg: LoraConfig,
    base_model_path: str | Path,
    *,
    trained_head: str | None = None,
) -> nn.Module:
    """``model`` (on the meta device or not) inside a peft LoRA wrapper; base weights frozen
    but for ``trained_head`` (see ``peft_config``), which stays trainable.

    The adapters are created on the device of the layer they attach to (meta here:
    FSDP2 and ``to_empty`` allocate them with the rest).
    """
    import peft

    try:
        wrapped = peft.get_peft_model(
            model, peft_config(cfg, base_model_path, trained_head=trained_head)
        )
    except ValueError as err:  # peft names the target modules it could not find
        raise ValueError(f"learner.lora.target_modules={cfg.target_modules}: {err}") from err
    if trained_head is not None:
        wrapped.get_base_model().get_submodule(trained_head).requires_grad_(True)
    return wrapped


def is_adapter(name: str) -> bool:
    """Whether a wrapped model's parameter name is a LoRA adapter weight."""
    return any(part in name for part in _ADAPTER_PARTS)


def checkpoint_name(name: str) -> str:
    """A wrapped model's (base) parameter name -> its Hugging Face checkpoint name."""
    return name.removeprefix(_WRAPPER_PREFIX).replace(_BASE_LAYER + ".", ".")


def init_adapters(model: nn.Module, seed: int) -> None:
    """A ~ U(±1/√fan_in) (peft's kaiming-uniform, a=√5), B = 0, drawn from ``seed``.

    Every rank draws the same full tensors in the same order and keeps its shard,
    so the result does not depend on the number of ranks.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            full = torch.empty(param.shape)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            fill_from_full(param, full)
        elif ".lora_B." in name:
            fill_from_full(param, torch.zeros(param.shape))


def reference_mode(model: nn.Module) -> AbstractContextManager:
    """The base model: the policy with its adapters switched off (peft's ``disable_adapter``)."""
    return model.disable_adapter()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def named_adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (peft saved name, full adapter tensor copied to the CPU), in state-dict order."""
    from peft import get_peft_model_state_dict

    saved = get_peft_model_state_dict(
        model, state_dict=model.state_dict(), adapter_name=ADAPTER_NAME
    )
    for name, tensor in saved.items():
        yield name, _full(tensor).to("cpu", copy=True)  # a copy: never a view of the live weights


def merged_weight(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """The full base tensor ``name`` with its layer's adapter folded in (unchanged if it has none).

    Collective when the layer has an adapter (its A and B are all-gathered).
    """
    if not name.endswith(_BASE_LAYER + ".weight"):
        return full
    layer = model.get_submodule(name.removesuffix(_BASE_LAYER + ".weight"))
    if ADAPTER_NAME not in getattr(layer, "lora_A", {}):
        return full
    lora_a = _full(layer.lora_A[ADAPTER_NAME].weight)
    lora_b = _full(layer.lora_B[ADAPTER_NAME].weight)
    delta = (lora_b.float() @ lora_a.float()) * layer.scaling[ADAPTER_NAME]
    if getattr(layer, "fan_in_fan_out", False):  # a Conv1D (GPT-2): its weight is [in, out]
        delta = delta.T
    return (full.float() + delta.to(full.device)).to(full.dtype)


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """``adapter_config.json`` as ``save_pretrained`` writes it (JSON types, inference mode)."""
    config = model.peft_config[ADAPTER_NAME].to_dict()
    config["inference_mode"] = True

    def plain(value: Any) -> Any:
        if isinstance(value, set):
            return sorted(value)
        raise TypeError(f"adapter config value {value!r} is not JSON-serialisable")

    return json.loads(json.dumps(config, default=plain))
