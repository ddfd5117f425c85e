"""AdapterSender against the real embedded engine: the engine serves what peft's model computes."""

from __future__ import annotations

import socket

import pytest
import requests
import torch

from rollout_fleet.engine import server
from weight_sync.adapter_sender import AdapterSender
from weight_sync.adapters import adapter_name
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineEndpoint
from weight_sync.errors import WeightSyncError

from .lora_fixtures import adapted_model, adapter_config, adapter_tensors, greedy_with_logprobs

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 9, 12, 7, 3, 22]
STEPS = 8


def _generate(url: str, lora: str | None) -> requests.Response:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "lora_path": lora,
    }
    return requests.post(url + "/generate", json=body, timeout=60)


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture()
def engine(tiny_model_dir):
    engine = server.EmbeddedEngine(str(tiny_model_dir), engine_id="lora-test", device="cpu")
    engine.start_server("127.0.0.1", 0)
    yield engine
    engine.stop()


def test_adapter_push_serves_the_adapted_model(tiny_model_dir, engine, tmp_path):
    url = engine.base_url
    base_tokens = _generate(url, None).json()["output_ids"]
    config = WeightSyncConfig(timeout_s=30)
    models = {v: adapted_model(tiny_model_dir, seed=v) for v in (1, 2)}
    sender = AdapterSender(config, adapter_dir=tmp_path, adapter_config=adapter_config(models[1]))
    with sender:
        sender.connect([EngineEndpoint("embedded", url, None)])
        for version, model in models.items():
            tensors = adapter_tensors(model)
            metrics = sender.publish(tensors, version)
            assert metrics.bytes == sum(t.numel() * t.element_size() for _, t in tensors)
            assert metrics.engines["embedded"].verified
            assert requests.get(url + "/model_info", timeout=30).json()["weight_version"] == str(
                version
            )

            out = _generate(url, adapter_name(version))
            assert out.status_code == 200, out.text
            reply = out.json()
            want_tokens, want_logprobs = greedy_with_logprobs(model, PROMPT, STEPS)
            assert reply["output_ids"] == want_tokens
            got = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want_logprobs, abs=1e-4)
            assert reply["meta_info"]["weight_version"] == str(version)
        assert want_tokens != base_tokens  # the adapters change what the engine says

        # one adapter at a time: the replaced name is SGLang's "not loaded", base is refused
        stale = _generate(url, adapter_name(1))
        assert stale.status_code == 400 and "not loaded" in stale.text
        assert _generate(url, None).status_code == 400
        # older folders are pruned: the current and the previous version stay
        tensors = adapter_tensors(models[1])
        sender.publish(tensors, 3)
        assert sorted(p.name for p in tmp_path.iterdir()) == [adapter_name(2), adapter_name(3)]
        # the same version again (a retry) is a no-op on an engine that holds it
        sender.publish(tensors, 3)
        assert engine.adapters == {adapter_name(3): str(tmp_path / adapter_name(3))}


def test_unloading_the_adapter_restores_the_base_weights(tiny_model_dir, engine, tmp_path):
    url = engine.base_url
    before = {k: v.clone() for k, v in engine.runner.model.state_dict().items()}
    model = adapted_model(tiny_model_dir, seed=3)
    with AdapterSender(
        WeightSyncConfig(timeout_s=30), adapter_dir=tmp_path, adapter_config=adapter_config(model)
    ) as sender:
        sender.connect([EngineEndpoint("embedded", url, None)])
        sender.publish(adapter_tensors(model), 1)
    changed = engine.runner.model.state_dict()
    assert not torch.equal(
        changed["model.layers.0.self_attn.q_proj.weight"],
        before["model.layers.0.self_attn.q_proj.weight"],
    )
    reply = requests.post(
        url + "/unload_lora_adapter", json={"lora_name": adapter_name(1)}, timeout=30
    )
    assert reply.status_code == 200 and reply.json()["loaded_adapters"] == {}
    for name, tensor in engine.runner.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    again = requests.post(
        url + "/unload_lora_adapter", json={"lora_name": adapter_name(1)}, timeout=30
    )
    assert again.status_code == 400 and "does not exist" in again.json()["error_message"]


def test_a_dead_engine_is_named_and_the_others_still_load(tiny_model_dir, engine, tmp_path):
    model = adapted_model(tiny_model_dir, seed=4)
    with AdapterSender(
        WeightSyncConfig(timeout_s=5), adapter_dir=tmp_path, adapter_config=adapter_config(model)
    ) as sender:
        sender.add_engine(EngineEndpoint("alive", engine.base_url, None))
        sender.add_engine(EngineEndpoint("dead", _closed_port_url(), None))
        with pytest.raises(WeightSyncError) as err:
            sender.publish(adapter_tensors(model), 1)
        assert err.value.engines == ["dead"] and "dead" in str(err.value)
        assert err.value.metrics is not None and err.value.metrics.engines["alive"].ok
        assert sender.engines == ["alive"]  # dropped: the membership hears of it via the outcome
    assert engine.adapters == {adapter_name(1): str(tmp_path / adapter_name(1))}


def test_a_bad_adapter_is_refused_and_the_engine_keeps_its_weights(
    tiny_model_dir, engine, tmp_path
):
    before = {k: v.clone() for k, v in engine.runner.model.state_dict().items()}
    reply = requests.post(
        engine.base_url + "/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(tmp_path / "missing")},
        timeout=30,
    )
    assert reply.status_code == 400
    assert "not a PEFT adapter folder" in reply.json()["error_message"]
    assert engine.adapters == {}
    for name, tensor in engine.runner.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
