"""A value head on any causal LM's backbone: the critic, and the reward model being trained.

transformers has a token classifier for some families only (none for OPT, GPT-J,
OLMo, Gemma 3 text), names its head ``score`` in some and ``classifier`` (with
its own dropout) in others. The learner's value models are therefore built one
way for every family, as OpenRLHF builds its critic: the causal LM's own
backbone (the module its files name ``<base_model_prefix>.*``, found by
``fleetrl.models.family.backbone``) and a ``score`` linear layer from the
backbone's last hidden state to ``num_labels`` values at every position.

    model = value_model(config, bias=True)       # on the meta device in the learner
    model(input_ids=..., position_ids=...).logits  # [rows, length, num_labels]

Names: the backbone's tensors are named as in the causal LM's files and the head
``score.weight`` (``score.bias``), which is how every ``*ForSequenceClassification``
of transformers names a reward model's, so a reward-model folder fills the
whole value model (``learner.critic.init_from``) and the trained reward model is
written as one (``learner.reward_export``). The class is a subclass of the
family's ``PreTrainedModel``, so gradient checkpointing, ``_no_split_modules``,
``_init_weights`` and peft's ``all-linear`` work as on the family's own classes.

Left out: a head other than one linear layer (no dropout: values must be deterministic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from fleetrl.models.family import backbone


def _family_base(model_class: type) -> type:
    """The family's ``PreTrainedModel`` subclass (``GPT2PreTrainedModel``, ...)."""
    from transformers import PreTrainedModel

    for cls in model_class.__mro__:
        family = cls is not PreTrainedModel and issubclass(cls, PreTrainedModel)
        if family and cls.__name__.endswith("PreTrainedModel"):
            return cls
    raise ValueError(f"{model_class.__name__} derives from no family PreTrainedModel")


def value_model(config: Any, *, bias: bool, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The backbone of ``config``'s causal LM with a ``score`` head of ``config.num_labels``
    outputs (``bias``: with a bias). Built on the current default device (meta in the learner)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_outputs import TokenClassifierOutput

    lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    body = backbone(lm)
    head_in = lm.get_output_embeddings().weight.shape[1]  # the last hidden state's width
    base = _family_base(type(lm))

    class ValueModel(base):
        def __init__(self) -> None:
            super().__init__(config)
            setattr(self, self.base_model_prefix, body)
            self.score = nn.Linear(head_in, config.num_labels, bias=bias, dtype=dtype)
            self.post_init()

        def get_input_embeddings(self) -> nn.Module:
            return body.get_input_embeddings()

        def forward(
            self,
            input_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None,
            use_cache: bool = False,
            **kwargs: Any,
        ) -> TokenClassifierOutput:
            hidden = body(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, **kwargs,
            ).last_hidden_state  # fmt: skip
            return TokenClassifierOutput(logits=self.score(hidden))

    ValueModel.__name__ = ValueModel.__qualname__ = base.__name__.replace(
        "PreTrainedModel", "ValueModel"
    )
    return ValueModel()


def check_critic_vocabulary(policy_path: Path, critic_path: Path) -> None:
    """The critic reads the policy's token ids: its embedding must hold every one of them."""
    if critic_path == policy_path:
        return
    from transformers import AutoConfig

    policy_vocab = AutoConfig.from_pretrained(policy_path).vocab_size
    critic_vocab = AutoConfig.from_pretrained(critic_path).vocab_size
    if critic_vocab < policy_vocab:
        raise ValueError(
            f"learner.critic.model_path: {critic_path} has a vocabulary of {critic_vocab} tokens, "
            f"fewer than the policy's {policy_vocab} ({policy_path}); the critic reads the "
            "policy's token ids, so start it from a model of the same tokenizer"
        )
