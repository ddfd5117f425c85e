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


def test_an_engine_that_joins_enters_the_group_before_anyone_pauses(tiny_model_dir, monkeypatch):
    # the weight group is formed again with the joiner while the engine already serving
    # generates; only then are both paused for the version, and the pause window is timed
    from weight_sync.engine_client import EngineClient

    calls: list[tuple[str, str]] = []
    for method in ("init_group", "pause", "resume"):
        original = getattr(EngineClient, method)

        def recorded(self, *args, _original=original, _method=method, **kwargs):
            calls.append((_method, self.name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(EngineClient, method, recorded)
    from transformers import AutoModelForCausalLM

    learner = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    engines = [
        server.EmbeddedEngine(str(tiny_model_dir), engine_id=f"join-{i}", device="cpu")
        for i in range(2)
    ]
    urls = [engine.start_server("127.0.0.1", 0) for engine in engines]
    try:
        config = WeightSyncConfig(bucket_mb=0.1, timeout_s=30, pause_mode="in_place")
        with WeightSender(config) as sender:
            sender.connect([EngineEndpoint("serving", urls[0], None)])
            sender.publish(module_named_tensors(learner), 0)
            calls.clear()
            sender.add_engine(EngineEndpoint("joiner", urls[1], None))
            metrics = sender.publish(module_named_tensors(learner), 1)
        assert calls.index(("init_group", "joiner")) < calls.index(("pause", "serving"))
        assert calls.index(("init_group", "serving")) < calls.index(("pause", "serving"))
        assert {n for m, n in calls if m == "pause"} == {"serving", "joiner"}
        assert metrics.group_setup_s > 0 and metrics.paused_s >= metrics.pause_s > 0
        for url in urls:
            assert requests.get(url + "/model_info", timeout=30).json()["weight_version"] == "1"
    finally:
        for engine in engines:
            engine.stop()
