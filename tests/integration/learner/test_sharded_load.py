"""Sharded loading: each rank's host memory at start is about its shard, and the weights are exact.

A 8-layer, hidden-512 Qwen2-shaped model (~80 MB in fp32, so the shard dominates
the fixed costs) is loaded by 2 and 4 gloo ranks; each rank reports its peak RSS
growth during the load and its shard size (printed: run with ``-s`` to see them).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from tests.integration.learner import load_procs, procs

# Fixed costs beyond the shard itself: FSDP bookkeeping, the staging buffer, allocator slack.
FIXED_OVERHEAD_MB = 24.0


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory):
    from fleetrl.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("mid") / "model",
        layers=8, hidden=512, heads=8, intermediate=1024, seed=1,
    )  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_about_its_shard_during_load_and_weights_equal_hf(
    mid_model_dir, tmp_path, world_size
):
    mp.spawn(
        load_procs.load_rank,
        args=(world_size, procs.free_port(), str(mid_model_dir), str(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    full_mb = sum(f.stat().st_size for f in mid_model_dir.glob("*.safetensors")) / 2**20
    for rank in range(world_size):
        fig = json.loads((tmp_path / f"rss_{world_size}_{rank}.json").read_text())
        print(
            f"ranks={world_size} rank={rank}: RSS growth during load {fig['rss_growth_mb']:.1f} MB, "
            f"shard {fig['shard_mb']:.1f} MB, full model {full_mb:.1f} MB"
        )
        assert fig["shard_mb"] < full_mb / world_size + 1.0
        assert fig["rss_growth_mb"] <= 1.5 * fig["shard_mb"] + FIXED_OVERHEAD_MB

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(mid_model_dir), dtype=torch.float32, local_files_only=True
    )
    loaded = torch.load(tmp_path / f"weights_{world_size}.pt")
    expected = dict(reference.state_dict())
    expected |= {f"buffer:{n}": b for n, b in reference.named_buffers()}
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
