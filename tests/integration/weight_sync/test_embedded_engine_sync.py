"""WeightSender against the real embedded engine (``rollout_fleet.engine``): bits and version."""

from __future__ import annotations

import pytest
import requests
import torch

from rollout_fleet.engine import server
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import EngineEndpoint, WeightSender
from weight_sync.sources import module_named_tensors

pytestmark = pytest.mark.timeout(180)


def test_embedded_engine_receives_every_version_bit_exact(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    learner = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    engine = server.EmbeddedEngine(str(tiny_model_dir), engine_id="ws-test", device="cpu")
    url = engine.start_server("127.0.0.1", 0)
    try:
        config = WeightSyncConfig(
            bucket_mb=0.1, timeout_s=30, pause_mode="abort", verify_tensors=1000, verify_rows=1000
        )
        with WeightSender(config) as sender:
            sender.connect([EngineEndpoint("embedded", url, None)])
            for version in range(2):
                with torch.no_grad():
                    for param in learner.parameters():
                        param.add_(0.05 * (version + 1))
                metrics = sender.publish(module_named_tensors(learner), version)
                assert metrics.engines["embedded"].verified  # verified by the sender
                assert metrics.num_buckets > 1
                info = requests.get(url + "/model_info", timeout=30).json()
                assert info["weight_version"] == str(version)
                held = engine.runner.model.state_dict()
                for name, tensor in module_named_tensors(learner):
                    assert torch.equal(held[name], tensor), name  # bit for bit
    finally:
        engine.stop()
