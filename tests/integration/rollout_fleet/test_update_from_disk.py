"""``POST /update_weights_from_disk`` on the embedded engine: a checkpoint folder replaces
the served weights in place, or is refused with SGLang's reply shape and changes nothing."""

from __future__ import annotations

import shutil

import pytest
import requests
import torch

from rollout_fleet.engine.server import EmbeddedEngine
from weight_sync.engine_client import EngineCallError, EngineClient, EngineEndpoint

PROBE = "model.layers.0.mlp.down_proj.weight"


def _rows(client: EngineClient) -> torch.Tensor:
    return torch.tensor(client.weights_by_name(PROBE, 3))


def _perturbed_copy(model_dir, out, scale: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    shutil.copytree(model_dir, out)
    for old in out.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(str(out))
    return model.state_dict()


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, engine_id="disk", max_running_requests=4)
    url = engine.start_server()
    client = EngineClient(EngineEndpoint("disk", url), timeout_s=30)
    yield engine, url, client
    client.close()
    engine.stop()


def test_a_folder_replaces_the_weights_and_model_info_names_it(served, tiny_model_dir, tmp_path):
    engine, url, client = served
    original = _rows(client)
    state = _perturbed_copy(tiny_model_dir, tmp_path / "scaled", 2.0)
    reply = client.update_weights_from_disk(str(tmp_path / "scaled"), weight_version="7")
    assert reply["success"] is True and reply["num_paused_requests"] == 0
    assert "Weight version updated to 7" in reply["message"]
    torch.testing.assert_close(_rows(client), state[PROBE][:3], rtol=0, atol=0)
    info = requests.get(f"{url}/model_info", timeout=5).json()
    assert info["weight_version"] == "7" and info["model_path"] == str(tmp_path / "scaled")
    client.update_weights_from_disk(str(tiny_model_dir))  # and back: no version given, kept
    torch.testing.assert_close(_rows(client), original, rtol=0, atol=0)
    assert requests.get(f"{url}/model_info", timeout=5).json()["weight_version"] == "7"


def test_a_partial_folder_another_architecture_or_an_unknown_name_is_refused_unchanged(
    served, tiny_model_dir, tiny_llama_dir, tmp_path
):
    _, url, client = served
    before = _rows(client)
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    tensors = {}
    for f in tiny_model_dir.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    save_file({n: t * 3 for n, t in tensors.items() if n != PROBE}, str(partial / "w.safetensors"))
    with pytest.raises(EngineCallError, match=r"HTTP 400: Failed to update weights: .*lacks 1"):
        client.update_weights_from_disk(str(partial))
    with pytest.raises(EngineCallError, match=r"lacks 6 .*q_proj.bias"):  # llama: no q/k/v biases
        client.update_weights_from_disk(str(tiny_llama_dir))
    extra = tmp_path / "extra"
    extra.mkdir()
    save_file({**tensors, "lm_head.bias": torch.zeros(3)}, str(extra / "w.safetensors"))
    with pytest.raises(EngineCallError, match="'lm_head.bias' is not a parameter"):
        client.update_weights_from_disk(str(extra))
    torch.testing.assert_close(_rows(client), before, rtol=0, atol=0)
    reply = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(partial)})
    assert reply.status_code == 400
    assert set(reply.json()) == {"success", "message", "num_paused_requests"}


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"model_path": "/no/such/folder"}, "is not a folder"),
        ({"model_path": "x", "load_format": "gguf"}, "load_format 'gguf'"),
        ({"model_path": "x", "is_async": True}, "is_async"),
        ({"model_path": "x", "shard": 1}, "shard"),
        ({}, "model_path"),
    ],
)
def test_bad_bodies_get_400_naming_what_is_wrong(served, body, names):
    _, url, _ = served
    reply = requests.post(f"{url}/update_weights_from_disk", json=body, timeout=10)
    assert reply.status_code == 400 and names in reply.text
