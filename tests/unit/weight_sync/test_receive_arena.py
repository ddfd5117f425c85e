"""The receiver's reusable arena: per-tensor views are aligned, disjoint and exactly sized."""

from __future__ import annotations

import torch

from weight_sync.buckets import TensorMeta
from weight_sync.receiver import ReceiveArena


def test_per_tensor_views_are_aligned_disjoint_and_reuse_one_buffer():
    arena = ReceiveArena(torch.device("cpu"))
    metas = [
        TensorMeta("a", torch.float32, (3, 5)),
        TensorMeta("b", torch.bfloat16, (7,)),
        TensorMeta("c", torch.int64, (2, 2)),
        TensorMeta("d", torch.uint8, (1,)),
    ]
    views = arena.tensors(metas)
    for meta, view in zip(metas, views, strict=True):
        assert view.dtype == meta.dtype and tuple(view.shape) == meta.shape
        assert view.data_ptr() % view.element_size() == 0
    for i, view in enumerate(views):  # writing one leaves the others untouched
        view.fill_(i + 1)
    for i, view in enumerate(views):
        assert torch.all(view == i + 1)
    base = views[0].untyped_storage().data_ptr()
    again = arena.tensors(metas)
    assert again[0].untyped_storage().data_ptr() == base  # no new allocation
    assert arena.flat(10).untyped_storage().data_ptr() == base


def test_arena_grows_for_a_larger_update():
    arena = ReceiveArena(torch.device("cpu"))
    assert arena.flat(8).numel() == 8
    big = arena.flat(4096)
    assert big.numel() == 4096 and big.dtype == torch.uint8
