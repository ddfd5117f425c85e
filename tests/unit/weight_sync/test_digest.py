"""Weights digest: equal exactly for bit-identical tensors; same stream rule as the learner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync.digest import StreamDigest, module_digest, module_named_tensors, state_digest


def test_digest_changes_with_a_single_flipped_bit():
    a = torch.randn(16)
    b = a.clone()
    b.view(torch.int32)[3] ^= 1
    assert state_digest([("w", a)]) == state_digest([("w", a.clone())])
    assert state_digest([("w", a)]) != state_digest([("w", b)])


def test_digest_depends_on_names_and_order_and_dtype():
    x, y = torch.ones(2), torch.zeros(2)
    assert state_digest([("x", x), ("y", y)]) != state_digest([("y", y), ("x", x)])
    assert state_digest([("x", x)]) != state_digest([("z", x)])
    assert state_digest([("x", torch.ones(2, dtype=torch.float32))]) != state_digest(
        [("x", torch.ones(4, dtype=torch.float16))]
    )


def test_per_tensor_hashes_ignore_order():
    a, b = StreamDigest(), StreamDigest()
    a.add("x", torch.ones(3))
    a.add("y", torch.zeros(3))
    b.add("y", torch.zeros(3))
    b.add("x", torch.ones(3))
    assert a.per_tensor == b.per_tensor
    with pytest.raises(ValueError, match="digested twice"):
        a.add("x", torch.ones(3))


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


def test_module_digest_matches_the_digest_of_its_published_stream():
    model = _Tied()
    assert module_digest(model).hexdigest() == state_digest(module_named_tensors(model))
