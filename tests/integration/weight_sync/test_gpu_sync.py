"""GPU weight sync (skipped without CUDA): bf16 parameters from a learner process to an engine process.

NCCL refuses two ranks of one communicator on the same GPU ("duplicate GPU"),
so the NCCL test needs two GPUs (learner on cuda:0, engine on cuda:1); on one
GPU the same CUDA bucket path is exercised with gloo over CUDA tensors.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.integration.weight_sync._engines import reference_engines

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def _bf16_weights(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (4096, 256), "proj.weight": (256, 256), "norm.weight": (256,)}
    return {
        n: torch.randn(s, generator=gen).to(torch.bfloat16).to(device) for n, s in shapes.items()
    }


def _sync_and_check(tmp_path, backend: str, learner_device: str, engine_device: str) -> None:
    from safetensors.torch import load_file

    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender

    weights = _bf16_weights(learner_device)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([[n, "bfloat16", list(t.shape)] for n, t in weights.items()]))
    args = ["--spec", str(spec), "--device", engine_device]
    with reference_engines({"gpu-engine": args}, tmp_path) as engines:
        url = engines["gpu-engine"].url
        config = WeightSyncConfig(backend=backend, bucket_mb=0.5, timeout_s=60)
        with WeightSender(config, device=learner_device) as sender:
            sender.connect([EngineEndpoint("gpu-engine", url, None)])
            for version in range(2):
                for tensor in weights.values():
                    tensor.add_(1.0)
                metrics = sender.publish(weights.items(), version)
                assert metrics.engines["gpu-engine"].verified and metrics.num_buckets > 1
        import requests

        out = str(tmp_path / "engine.safetensors")
        requests.post(url + "/fleetrl/reference/save", json={"path": out}, timeout=60)
        held = load_file(out)
        for name, tensor in weights.items():
            assert held[name].dtype == torch.bfloat16
            assert torch.equal(held[name], tensor.cpu()), name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL needs a distinct GPU per rank: learner on cuda:0, engine on cuda:1",
)
def test_nccl_sync_of_bf16_weights_is_bit_exact(tmp_path):
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    _sync_and_check(tmp_path, "nccl", "cuda:0", "cuda:1")


def test_cuda_buckets_over_gloo_on_one_gpu_are_bit_exact(tmp_path):
    _sync_and_check(tmp_path, "gloo", "cuda:0", "cuda:0")
