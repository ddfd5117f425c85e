"""Weight-sync config: the bucket size is per backend unless set."""

from __future__ import annotations

import pytest

from weight_sync.config import (
    DEFAULT_BUCKET_MB,
    WeightSyncConfig,
    bucket_mb_for,
    zero_copy_bytes_for,
)


def test_unset_bucket_size_follows_the_backend_and_a_set_one_wins():
    unset = WeightSyncConfig()
    assert bucket_mb_for(unset, "gloo") == DEFAULT_BUCKET_MB["gloo"]
    assert bucket_mb_for(unset, "nccl") == DEFAULT_BUCKET_MB["nccl"]
    assert bucket_mb_for(WeightSyncConfig(bucket_mb=3.0), "gloo") == 3.0
    with pytest.raises(ValueError, match="no default bucket size for 'mpi'"):
        bucket_mb_for(unset, "mpi")


def test_zero_copy_threshold_is_per_device_for_buckets_and_zero_for_per_tensor():
    buckets = WeightSyncConfig(load_format="flattened_bucket")
    assert zero_copy_bytes_for(buckets, "cpu") == 2**20
    assert zero_copy_bytes_for(buckets, "cuda") is None  # the GPU path packs everything
    assert zero_copy_bytes_for(WeightSyncConfig(load_format="per_tensor"), "cuda") == 0
