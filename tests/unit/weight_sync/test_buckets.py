"""Bucket packing: byte-exact round trips, size boundaries, dtype grouping, metadata validation."""

from __future__ import annotations

import pytest
import torch

from weight_sync.buckets import (
    BucketPacker,
    BufferPool,
    TensorMeta,
    dtype_name,
    metas_from_wire,
    pack_buckets,
    parse_dtype,
    unpack_bucket,
)


def _named(*specs):
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, dtype, shape in specs:
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            t = torch.randint(-100, 100, shape, generator=gen).to(dtype)
        out.append((name, t))
    return out


def _roundtrip(buckets):
    got = {}
    for bucket in buckets:
        wire = bucket.wire_fields()
        metas = metas_from_wire(wire["names"], wire["dtypes"], wire["shapes"])
        for name, tensor in unpack_bucket(bucket.flat.clone(), metas):
            got[name] = tensor
    return got


def test_pack_unpack_round_trip_is_bit_exact_across_dtypes():
    named = _named(
        ("a", torch.float32, (3, 5)),
        ("b", torch.bfloat16, (7,)),
        ("c", torch.float16, (2, 2, 2)),
        ("d", torch.int64, (4,)),
        ("e", torch.bool, (9,)),
        ("f", torch.float32, ()),
        ("g", torch.int8, (0, 3)),
    )
    got = _roundtrip(pack_buckets(named, bucket_bytes=64))
    assert set(got) == {n for n, _ in named}
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(
            got[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        )


def test_every_bucket_holds_one_dtype_and_respects_the_size_limit():
    named = _named(
        *[(f"w{i}", torch.float32 if i % 2 else torch.bfloat16, (10,)) for i in range(20)]
    )
    buckets = list(pack_buckets(named, bucket_bytes=100))
    for bucket in buckets:
        assert len({m.dtype for m in bucket.metas}) == 1
        assert bucket.nbytes <= 100
    # 10 float32 tensors of 40 bytes: two per bucket; 10 bf16 of 20 bytes: five per bucket
    assert sorted(len(b.metas) for b in buckets) == [2] * 5 + [5] * 2


def test_bucket_closes_exactly_at_the_boundary():
    named = _named(*[(f"w{i}", torch.float32, (4,)) for i in range(5)])  # 16 bytes each
    buckets = list(pack_buckets(named, bucket_bytes=32))
    assert [len(b.metas) for b in buckets] == [2, 2, 1]
    assert [b.nbytes for b in buckets] == [32, 32, 16]
    assert [b.index for b in buckets] == [0, 1, 2]


def test_tensor_larger_than_a_bucket_gets_its_own_bucket_without_a_copy():
    small = _named(("s0", torch.float32, (2,)), ("s1", torch.float32, (2,)))
    big_name, big = _named(("big", torch.float32, (100,)))[0]
    buckets = list(pack_buckets([small[0], (big_name, big), small[1]], bucket_bytes=64))
    alone = [b for b in buckets if any(m.name == "big" for m in b.metas)]
    assert len(alone) == 1 and len(alone[0].metas) == 1
    assert alone[0].flat.data_ptr() == big.data_ptr()  # a view, not a copy
    assert [m.name for b in buckets if b is not alone[0] for m in b.metas] == ["s0", "s1"]


def test_non_contiguous_tensors_pack_their_logical_values():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got = _roundtrip(pack_buckets([("t", base.t())], bucket_bytes=1024))
    assert torch.equal(got["t"], base.t())


def test_repeated_name_in_a_stream_is_rejected():
    packer = BucketPacker(64)
    packer.add("x", torch.zeros(1))
    with pytest.raises(ValueError, match="'x' appears twice"):
        packer.add("x", torch.zeros(1))


def test_mixed_dtype_bucket_from_another_sender_unpacks_even_when_misaligned():
    # newer SGLang senders pack several dtypes into one byte buffer
    parts = _named(("i8", torch.int8, (3,)), ("f32", torch.float32, (2,)))
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in parts])
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in parts]
    got = dict(unpack_bucket(flat, metas))
    assert torch.equal(got["i8"], parts[0][1]) and torch.equal(got["f32"], parts[1][1])


def test_unpack_rejects_a_buffer_whose_size_disagrees_with_the_metadata():
    with pytest.raises(ValueError, match="holds 10 bytes but its metadata describes 16"):
        unpack_bucket(torch.zeros(10, dtype=torch.uint8), [TensorMeta("a", torch.float32, (4,))])


def test_wire_metadata_errors_name_the_field_and_tensor():
    with pytest.raises(ValueError, match="lengths differ"):
        metas_from_wire(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(ValueError, match=r"dtypes\[0\] \(a\): unknown dtype 'float13'"):
        metas_from_wire(["a"], ["float13"], [[1]])
    with pytest.raises(ValueError, match=r"shapes\[0\] \(a\): negative"):
        metas_from_wire(["a"], ["float32"], [[-1]])


def test_dtype_names_round_trip_and_accept_the_torch_prefix():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert parse_dtype(dtype_name(dtype)) is dtype
    assert parse_dtype("torch.bfloat16") is torch.bfloat16


def test_per_tensor_requests_group_metadata_and_keep_each_tensor_uncopied():
    named = _named(*[(f"w{i}", torch.float32, (4,)) for i in range(5)])  # 16 bytes each
    requests = list(pack_buckets(named, 32, zero_copy_bytes=0))
    assert [[m.name for m in r.metas] for r in requests] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [r.load_format for r in requests] == [None, None, None]
    parts = [p for r in requests for p in r.broadcast_tensors()]
    assert [p.data_ptr() for p in parts] == [t.data_ptr() for _, t in named]
    assert sum(r.nbytes for r in requests) == 80


def _received(buckets):
    """What a receiver loads from each request, flattened or per-tensor."""
    got = {}
    for bucket in buckets:
        if bucket.load_format is None:
            got.update((m.name, p.clone()) for m, p in zip(bucket.metas, bucket.parts, strict=True))
        else:
            got.update(_roundtrip([bucket]))
    return got


def test_zero_copy_sends_large_tensors_uncopied_and_packs_the_small_ones():
    named = _named(
        ("norm0", torch.float32, (4,)),  # 16 B: packed
        ("big0", torch.float32, (16,)),  # 64 B: uncopied
        ("norm1", torch.bfloat16, (4,)),  # 8 B: packed, its own dtype bucket
        ("big1", torch.bfloat16, (40,)),  # 80 B: uncopied, beside float32 in one request
        ("norm2", torch.float32, (4,)),
    )
    buckets = list(pack_buckets(named, 256, zero_copy_bytes=64))
    # the open per-tensor request first, then the flat buckets in the order they opened
    assert [(b.load_format, [m.name for m in b.metas]) for b in buckets] == [
        (None, ["big0", "big1"]),
        ("flattened_bucket", ["norm0", "norm2"]),
        ("flattened_bucket", ["norm1"]),
    ]
    tensors = dict(named)
    assert [p.data_ptr() for p in buckets[0].parts] == [
        tensors["big0"].data_ptr(),
        tensors["big1"].data_ptr(),
    ]
    got = _received(buckets)
    assert got.keys() == tensors.keys()
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_zero_copy_requests_hold_at_most_a_bucket_and_a_larger_tensor_goes_alone():
    named = _named(
        ("a", torch.float32, (16,)),  # 64 B
        ("b", torch.float32, (16,)),
        ("c", torch.float32, (16,)),  # would make 192 B > 128: a new request
        ("huge", torch.float32, (64,)),  # 256 B > bucket: alone, uncopied, not a byte view
        ("d", torch.float32, (16,)),
    )
    packer = BucketPacker(128, zero_copy_bytes=64)
    emitted = [[m.name for m in b.metas] for name, t in named for b in packer.add(name, t)]
    assert emitted == [["a", "b"], ["c"], ["huge"]]
    rest = packer.finish()
    assert [[m.name for m in b.metas] for b in rest] == [["d"]]
    assert all(b.load_format is None for b in rest)


def test_zero_copy_threshold_is_checked_and_duplicates_still_fail():
    with pytest.raises(ValueError, match="zero_copy_bytes must be >= 0 or None, got -1"):
        BucketPacker(64, zero_copy_bytes=-1)
    packer = BucketPacker(64, zero_copy_bytes=8)
    packer.add("w", torch.zeros(4))
    with pytest.raises(ValueError, match="'w' appears twice"):
        packer.add("w", torch.zeros(4))


def test_pooled_buffers_are_reused_across_versions_and_stay_bit_exact():
    specs = [(f"w{i}", torch.float32, (64,)) for i in range(8)]  # 256 B each
    pool = BufferPool(1024, "cpu")
    for version in range(3):
        named = [(n, t + version) for n, t in _named(*specs)]
        buckets = list(pack_buckets(named, 1024, "cpu", pool))
        got = _roundtrip(buckets)
        for name, tensor in named:
            assert torch.equal(got[name], tensor), (version, name)
        for bucket in buckets:
            bucket.release(pool)
    # two full buckets per version, made once: later versions pack into returned buffers
    assert pool.allocations == 2


def test_pool_ignores_foreign_buffers_and_keeps_at_most_max_free():
    pool = BufferPool(16, "cpu", max_free=1)
    pool.give(torch.empty(8, dtype=torch.uint8))  # another size
    pool.give(None)
    first, second = pool.take(), pool.take()
    pool.give(first)
    pool.give(second)  # over max_free: dropped
    assert pool.take() is first
    assert pool.allocations == 2
    with pytest.raises(ValueError, match="pool holds 16 bytes"):
        BucketPacker(32, "cpu", pool)
