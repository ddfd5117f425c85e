"""The embedded engine's co-location routes over HTTP, with SGLang's semantics.

``/release_memory_occupation`` and ``/resume_memory_occupation`` answer 200 with a null
body; release is refused while a request runs; a request that arrives while memory is
released waits and completes after resume and continue. ``/update_weights_from_tensor``
is refused outside the update session and while the weights are released, records the
version, and refuses a payload carrying anything but tensors.
"""

from __future__ import annotations

import base64
import os
import pickle
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from rollout_fleet.engine.colocated_routes import OUTSIDE_SESSION, same_host
from rollout_fleet.engine.server import EmbeddedEngine
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineEndpoint
from weight_sync.errors import WeightSyncError, drain_stream
from weight_sync.tensor_push import TensorSender

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def served(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, engine_id="coloc", memory_saver=True)
    url = engine.start_server()
    yield engine, url
    engine.stop()


def _post(url: str, route: str, body=None, timeout: float = 30) -> requests.Response:
    return requests.post(f"{url}{route}", json=body, timeout=timeout)


def _generate(url: str, tokens: int = 3) -> dict:
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": tokens}}
    return _post(url, "/generate", body, timeout=120).json()


def _memory(url: str) -> dict:
    info = requests.get(f"{url}/get_server_info", timeout=10).json()
    return info["internal_states"][0]["memory_usage"]


def _learner_tensors(engine: EmbeddedEngine, shift: float) -> list[tuple[str, torch.Tensor]]:
    """What a learner would send: the engine's parameter names, values moved by ``shift``."""
    torch.manual_seed(0)
    return [
        (n, torch.randn_like(p) * 0.02 + shift) for n, p in engine.runner.model.named_parameters()
    ]


def test_the_cycle_frees_memory_and_serves_the_pushed_version(served):
    engine, url = served
    _generate(url)
    assert _memory(url)["weight"] > 0
    assert _post(url, "/pause_generation", {"mode": "abort"}).status_code == 200
    released = _post(url, "/release_memory_occupation", {"tags": None})
    assert released.status_code == 200 and released.json() is None
    assert _memory(url) == {"weight": 0.0, "kvcache": 0.0, "graph": {}}

    resumed = _post(url, "/resume_memory_occupation", {"tags": ["cuda_graph", "weights"]})
    assert resumed.status_code == 200 and resumed.json() is None
    sent = _learner_tensors(engine, 0.5)
    config = WeightSyncConfig(bucket_mb=0.05, verify_tensors=100, verify_rows=100)
    with TensorSender(config) as sender:
        sender.set_members([EngineEndpoint("coloc", url)])
        push = sender.start(4)
        drain_stream(push.tap(iter(sent)))
        metrics = push.finish()
        # the staging buffers (the largest tensor each) are freed once the engine answered
        largest = max(t.numel() * t.element_size() for _, t in sent)
        assert push.staging_bytes >= 2 * largest and sender.buffer_bytes == 0
    assert metrics.num_buckets > 1 and all(s.ok and s.verified for s in metrics.engines.values())
    assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert _post(url, "/continue_generation", {}).status_code == 200
    held = engine.runner.named_weights()
    assert all(torch.equal(held[name], tensor) for name, tensor in sent)
    out = _generate(url)
    assert out["meta_info"]["weight_version"] == "4"


def test_release_is_refused_while_a_request_runs(served):
    _, url = served
    finished = {}
    request = threading.Thread(target=lambda: finished.update(_generate(url, tokens=60)))
    request.start()
    deadline = time.monotonic() + 30
    refused = None
    while time.monotonic() < deadline and request.is_alive():
        reply = _post(url, "/release_memory_occupation", {})
        if reply.status_code == 400:
            refused = reply
            break
        _post(url, "/resume_memory_occupation", {})  # it was idle: take it back, try again
    request.join(120)
    assert refused is not None and "only when server is idle" in refused.json()["error"]["message"]
    assert finished["meta_info"]["finish_reason"]["type"] == "length"


def test_a_request_arriving_while_released_waits_for_resume(served):
    _, url = served
    assert _post(url, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    result = {}
    waiting = threading.Thread(target=lambda: result.update(_generate(url)))
    waiting.start()
    waiting.join(1.5)
    assert waiting.is_alive() and not result  # nothing runs on released memory
    assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    waiting.join(60)
    assert result["meta_info"]["completion_tokens"] == 3


def test_resuming_a_tag_never_released_is_refused(served):
    _, url = served
    reply = _post(url, "/resume_memory_occupation", {"tags": ["weights"]})
    assert reply.status_code == 400 and "were not released" in reply.json()["error"]["message"]
    unknown = _post(url, "/release_memory_occupation", {"tags": ["kvcache"]})
    assert unknown.status_code == 400 and "accepted" in unknown.json()["error"]["message"]


def test_tensor_updates_follow_the_session_rule_and_the_released_weights(served):
    engine, url = served
    sent = _learner_tensors(engine, 0.1)
    body = {"serialized_named_tensors": ["unused"], "load_format": "flattened_bucket"}
    outside = _post(url, "/update_weights_from_tensor", body)
    assert outside.status_code == 400 and outside.json()["message"] == OUTSIDE_SESSION
    _post(url, "/pause_generation", {"mode": "abort"})
    _post(url, "/release_memory_occupation", {"tags": ["weights"]})
    config = WeightSyncConfig(verify=False)
    with TensorSender(config) as sender:
        sender.set_members([EngineEndpoint("coloc", url)])
        with pytest.raises(WeightSyncError, match="is released"):
            sender.publish(iter(sent), version=2)
    _post(url, "/resume_memory_occupation", {"tags": ["weights"]})


def test_a_payload_that_is_not_tensors_is_refused_and_never_runs(served, tmp_path):
    _, url = served
    marker = tmp_path / "ran"

    class Gadget:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    payload = base64.b64encode(pickle.dumps(Gadget())).decode()
    assert _post(url, "/begin_weight_update", {}).status_code == 200
    reply = _post(
        url,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [payload], "load_format": None},
    )
    _post(url, "/end_weight_update", {})
    assert reply.status_code == 400 and "is not admitted" in reply.json()["message"]
    assert not marker.exists()


def test_only_a_caller_on_this_host_may_send_memory_handles():
    def request(peer: str, local: str):
        transport = SimpleNamespace(get_extra_info=lambda key: (local, 30000))
        return SimpleNamespace(remote=peer, transport=transport)

    assert same_host(request("127.0.0.1", "127.0.0.1"))
    assert same_host(request("::1", "::1"))
    assert same_host(request("10.0.0.5", "10.0.0.5"))  # this host through its own address
    assert not same_host(request("10.0.0.9", "10.0.0.5"))
    assert not same_host(request("", "10.0.0.5"))
