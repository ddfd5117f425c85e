"""The tensors a model publishes follow the learner's rule: state_dict order, tied once."""

from __future__ import annotations

import torch
from torch import nn

from weight_sync.sources import module_named_tensors


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("persistent", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_module_tensors_follow_the_learner_rule_tied_once_persistent_buffers_kept():
    names = [n for n, _ in module_named_tensors(_Tied())]
    # state_dict order: the root's own buffers first, then children; head.weight is embed.weight
    assert names == ["persistent", "embed.weight", "norm.weight", "norm.bias"]
