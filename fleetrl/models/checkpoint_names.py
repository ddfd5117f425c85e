"""A model's weight names as its files hold them, and back: transformers' own renamings.

transformers 5 renames some checkpoint keys on load and back on save
(``transformers.conversion_mapping``): a GPT-NeoX folder holds ``embed_out.weight``,
its model calls the tensor ``lm_head.weight``; Llama, Qwen2, GPT-2, OPT, Phi
and Gemma rename nothing. fleetrl speaks the files' names wherever a name
leaves a process or meets a file: the learner reads its shards from the
files by them (``learner.sharded_load``), publishes weights under them
(``learner.weights_out``, ``weight_sync.sources``: what SGLang's and vLLM's
loaders take, and what a snapshot folder holds), and the embedded engine
accepts them beside its module names (``ModelRunner.named_weights``).

    names = CheckpointNames.of(model)  # any Hugging Face model (peft, FSDP looked through)
    names.to_file("lm_head.weight")  # "embed_out.weight" for GPT-NeoX
    names.to_module("embed_out.weight")

Only renamings are followed. A family whose files transformers *converts* on
load (experts stacked into one tensor, fused projections split) has no file
tensor per module tensor; ``converted`` names such a model, and
``fleetrl check`` refuses it for the learner's sharded loading.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class CheckpointNames:
    """Module name <-> file name of one family's tensors (identity where nothing is renamed)."""

    def __init__(self, config: Any) -> None:
        self.renamings: list[Any] = []
        self.reverse_renamings: list[Any] = []
        self.converted: list[str] = []  # source patterns of conversions that change tensors
        if config is None:
            return
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                PrefixChange,
                WeightConverter,
                WeightRenaming,
            )
        except ImportError:  # transformers 4: no conversions, names are the files'
            return
        conversions = [
            c
            for c in get_model_conversion_mapping(_causal_lm(config), add_legacy=False)
            if not isinstance(c, PrefixChange)
        ]
        self.renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        self.converted = [
            str(p) for c in conversions if isinstance(c, WeightConverter) for p in c.source_patterns
        ]
        self.reverse_renamings = [
            r
            for r in (c.reverse_transform() for c in conversions[::-1])
            if isinstance(r, WeightRenaming)
        ]

    @classmethod
    def of(cls, model: nn.Module) -> CheckpointNames:
        """The names of ``model``'s family (a peft or FSDP wrapper is looked through; its
        config decides): a critic's or reward model's backbone is named as its causal LM's."""
        from fleetrl.models.family import unwrap

        config = getattr(unwrap(model), "config", None)
        key = type(config)  # the classes, hence the renamings, follow the config's class
        if key not in _BY_CONFIG_CLASS:
            _BY_CONFIG_CLASS[key] = cls(config)
        return _BY_CONFIG_CLASS[key]

    def to_file(self, name: str) -> str:
        """The name the model's files give its tensor ``name``."""
        return _apply(name, self.reverse_renamings)

    def to_module(self, name: str) -> str:
        """The model's name of the file tensor ``name``."""
        return _apply(name, self.renamings)


_BY_CONFIG_CLASS: dict[type, CheckpointNames] = {}


def _causal_lm(config: Any) -> nn.Module:
    """The family's causal LM on the meta device: its class names select the renamings."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _apply(name: str, renamings: list[Any]) -> str:
    if not renamings:
        return name
    from transformers.core_model_loading import apply_renamings

    return apply_renamings(name, renamings)
