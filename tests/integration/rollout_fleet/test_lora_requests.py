"""Rollout requests under LoRA weight sync, on the real stack (SampleRunner -> EngineClient ->
EmbeddedEngine), with adapters pushed by ``AdapterSender``: each request names the engine's
current adapter, its tokens carry that adapter's version and are what peft's adapted model
says, a request naming a replaced adapter is resubmitted under the new name, and a request
waiting when the adapter switches finishes with abort (the runner resubmits it)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import requests

from rollout_fleet.adapters import AdapterNames
from rollout_fleet.client import EngineClient
from rollout_fleet.engine.server import EmbeddedEngine
from rollout_fleet.membership import Membership
from rollout_fleet.router import Router
from rollout_fleet.sample_runner import SampleRunner
from rollout_fleet.trajectory import SampleProgress
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

pytestmark = pytest.mark.timeout(240)

PROMPT = [4, 8, 15, 16, 23, 2]
STEPS = 6
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture()
def engine(tiny_model_dir):
    engine = EmbeddedEngine(str(tiny_model_dir), engine_id="lora-rollout", device="cpu")
    engine.start_server("127.0.0.1", 0)
    yield engine
    engine.stop()


def _run_sample(runner: SampleRunner) -> SampleProgress:
    sample = SampleProgress(prompt_ids=list(PROMPT), max_new_tokens=STEPS)

    async def go():
        try:
            await runner.generate("g", "u", sample, dict(GREEDY))
        finally:
            await runner.aclose()

    asyncio.run(go())
    return sample


def test_requests_name_the_current_adapter_and_carry_its_version(tiny_model_dir, engine, tmp_path):
    models = {v: adapted_model(tiny_model_dir, seed=10 + v) for v in (0, 1)}
    adapters = AdapterNames()
    with AdapterSender(
        WeightSyncConfig(timeout_s=30),
        adapter_dir=tmp_path,
        adapter_config=adapter_config(models[0]),
    ) as sender:
        sender.connect([EngineEndpoint("e0", engine.base_url, None)])
        for version, model in models.items():
            sender.publish(adapter_tensors(model), version)
            members = Membership()
            members.launch("e0", engine.base_url)
            members.weights_loaded("e0", 0)
            router = Router(members)
            runner = SampleRunner(
                router,
                {"e0": EngineClient(engine.base_url)},
                retry_backoff_s=0.01,
                adapters=adapters,  # kept across versions: it still names v0 when v1 lands
            )
            sample = _run_sample(runner)
            want, _ = greedy_with_logprobs(model, PROMPT, STEPS)
            assert sample.output_ids == want
            assert sample.token_versions == [version] * STEPS
            assert runner.engine_errors == 0
    # v0 was asked for once; v1 once more after the engine said v0 is gone
    assert adapters.refreshes == 2


def test_a_request_waiting_when_the_adapter_switches_is_aborted_for_resubmission(
    tiny_model_dir, engine, tmp_path
):
    url = engine.base_url
    models = {v: adapted_model(tiny_model_dir, seed=20 + v) for v in (0, 1)}
    with AdapterSender(
        WeightSyncConfig(timeout_s=30),
        adapter_dir=tmp_path,
        adapter_config=adapter_config(models[0]),
    ) as sender:
        sender.connect([EngineEndpoint("e0", url, None)])
        sender.publish(adapter_tensors(models[0]), 0)
        requests.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
        replies: list[requests.Response] = []
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": STEPS, **GREEDY},
            "return_logprob": True,
            "lora_path": adapter_name(0),
        }
        thread = threading.Thread(
            target=lambda: replies.append(requests.post(url + "/generate", json=body, timeout=60))
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not engine.scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.publish(adapter_tensors(models[1]), 1)  # no pause needed: adapters are per request
        thread.join(60)
        requests.post(url + "/continue_generation", json={}, timeout=30)
    reply = replies[0].json()
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert "replaced" in reply["meta_info"]["finish_reason"]["message"]
