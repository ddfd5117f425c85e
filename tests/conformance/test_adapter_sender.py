"""fleetrl's AdapterSender and LoRA rollout requests against SGLang's own server code.

The engine runs SGLang 0.5.23's HTTP app and its TokenizerManager LoRA code
(``LoRARegistry``, ``load_lora_adapter`` / ``unload_lora_adapter`` with their
locks and LRU eviction, ``lora_path`` resolution with its errors) started with
the LoRA server args fleetrl's launcher sets; per TP rank, adapters are applied
with peft (``sglang_engine.lora``). What passes here is the adapter route a GPU
run takes: folder by path, name per version, version in ``/model_info``,
requests naming their adapter, stale names failing with SGLang's own errors.
"""

from __future__ import annotations

import asyncio

import pytest
import requests

from rollout_fleet.adapters import AdapterNames, is_adapter_gone
from rollout_fleet.client import EngineClient, EngineError
from rollout_fleet.membership import Membership
from rollout_fleet.router import Router
from rollout_fleet.sample_runner import SampleRunner
from rollout_fleet.trajectory import SampleProgress
from tests.conformance.conftest import CONFORMANCE_API_KEY
from tests.conformance.sglang_engine import start_sglang_engine
from tests.integration.weight_sync.lora_fixtures import (
    adapted_model,
    adapter_config,
    adapter_tensors,
    greedy_with_logprobs,
)
from weight_sync.adapter_sender import AdapterSender
from weight_sync.adapters import adapter_name
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineEndpoint
from weight_sync.errors import WeightSyncError

pytestmark = pytest.mark.timeout(600)

PROMPT = [3, 14, 15, 9, 2, 6]
STEPS = 5
RANK = 8


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    engine = start_sglang_engine(
        tiny_model_dir, tp_size=2, api_key=CONFORMANCE_API_KEY, lora_rank=RANK
    )
    yield engine
    engine.stop()


def _generate(engine, lora: str | None) -> requests.Response:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    if lora is not None:
        body["lora_path"] = lora
    return requests.post(f"{engine.url}/generate", json=body, headers=engine.headers, timeout=120)


def test_adapter_versions_load_by_path_and_serve_per_request(lora_engine, tiny_model_dir, tmp_path):
    models = {v: adapted_model(tiny_model_dir, rank=RANK, seed=30 + v) for v in range(3)}
    endpoint = EngineEndpoint("sglang", lora_engine.url, lora_engine.api_key, world_size=2)
    with AdapterSender(
        WeightSyncConfig(timeout_s=120),
        adapter_dir=tmp_path,
        adapter_config=adapter_config(models[0]),
    ) as sender:
        sender.connect([endpoint])
        for version, model in models.items():
            metrics = sender.publish(adapter_tensors(model), version)
            assert metrics.engines["sglang"].verified
            info = requests.get(
                f"{lora_engine.url}/model_info", headers=lora_engine.headers, timeout=30
            ).json()
            assert info["weight_version"] == str(version)
            reply = _generate(lora_engine, adapter_name(version))
            assert reply.status_code == 200, reply.text
            want_tokens, want_logprobs = greedy_with_logprobs(model, PROMPT, STEPS)
            assert reply.json()["output_ids"] == want_tokens
            got = [e[0] for e in reply.json()["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want_logprobs, abs=1e-4)
        # SGLang keeps the previous adapter for requests still using it: v1 serves v1
        previous = _generate(lora_engine, adapter_name(1))
        assert previous.status_code == 200
        assert previous.json()["output_ids"] == greedy_with_logprobs(models[1], PROMPT, STEPS)[0]
        # the base model is still served beside the adapters
        assert _generate(lora_engine, None).status_code == 200

    # v0 was unloaded and its folder deleted: SGLang's implicit reload fails, loudly
    stale = _generate(lora_engine, adapter_name(0))
    assert stale.status_code == 400 and "implicitly load LoRA adapter" in stale.text
    never = _generate(lora_engine, "fleetrl-policy-v99")
    assert never.status_code == 400 and "never been loaded" in never.text
    for response in (stale, never):
        error = EngineError(lora_engine.url, "/generate", 400, response.json()["error"]["message"])
        assert is_adapter_gone(error)


def test_rollout_requests_follow_the_engines_adapter(lora_engine, tiny_model_dir, tmp_path):
    model = adapted_model(tiny_model_dir, rank=RANK, seed=40)
    with AdapterSender(
        WeightSyncConfig(timeout_s=120), adapter_dir=tmp_path, adapter_config=adapter_config(model)
    ) as sender:
        sender.connect(
            [EngineEndpoint("sglang", lora_engine.url, lora_engine.api_key, world_size=2)]
        )
        sender.publish(adapter_tensors(model), 7)
    members = Membership()
    members.launch("sglang", lora_engine.url)
    members.weights_loaded("sglang", 0)
    router = Router(members)
    runner = SampleRunner(
        router,
        {"sglang": EngineClient(lora_engine.url, api_key=lora_engine.api_key)},
        retry_backoff_s=0.01,
        adapters=AdapterNames(),
    )
    sample = SampleProgress(prompt_ids=list(PROMPT), max_new_tokens=STEPS)

    async def go():
        try:
            await runner.generate("g", "u", sample, {"temperature": 0.0, "ignore_eos": True})
        finally:
            await runner.aclose()

    asyncio.run(go())
    assert sample.output_ids == greedy_with_logprobs(model, PROMPT, STEPS)[0]
    assert sample.token_versions == [7] * STEPS


def test_an_engine_without_lora_is_named(sglang_engine, tiny_model_dir, tmp_path):
    model = adapted_model(tiny_model_dir, rank=RANK, seed=50)
    with AdapterSender(
        WeightSyncConfig(timeout_s=60), adapter_dir=tmp_path, adapter_config=adapter_config(model)
    ) as sender:
        sender.add_engine(EngineEndpoint("plain", sglang_engine.url, sglang_engine.api_key))
        with pytest.raises(WeightSyncError) as err:
            sender.publish(adapter_tensors(model), 1)
    assert err.value.engines == ["plain"]
    assert "LoRA is not enabled" in str(err.value)
