"""Weight-sync config: the bucket size is per backend unless set."""

from __future__ import annotations

import pytest

from weight_sync.config import DEFAULT_BUCKET_MB, WeightSyncConfig, bucket_mb_for


def test_unset_bucket_size_follows_the_backend_and_a_set_one_wins():
    unset = WeightSyncConfig()
    assert bucket_mb_for(unset, "gloo") == DEFAULT_BUCKET_MB["gloo"]
    assert bucket_mb_for(unset, "nccl") == DEFAULT_BUCKET_MB["nccl"]
    assert bucket_mb_for(WeightSyncConfig(bucket_mb=3.0), "gloo") == 3.0
    with pytest.raises(ValueError, match="no default bucket size for 'mpi'"):
        bucket_mb_for(unset, "mpi")
