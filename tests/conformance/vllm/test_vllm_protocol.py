"""fleetrl's vLLM clients, sender and launcher against vLLM 0.34's own code (harness.py).

Every engine here starts on a ``vllm serve`` command line ``build_command`` made, parsed by
vLLM's own serve parser and ``validate_parsed_serve_args``; every body below is parsed by
vLLM's request models and answered by its routes and serving classes.
"""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch

from rollout_fleet.vllm_client import VllmEngineClient
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineEndpoint
from weight_sync.sender import WeightSender


def _client(engine) -> VllmEngineClient:
    return VllmEngineClient(engine.url, api_key=engine.key, timeout_s=60)


def _sample(engine, ids, tokens=4, rid="r1"):
    async def run():
        async with _client(engine) as client:
            return await client.generate_sample(
                ids,
                {"max_new_tokens": tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
                rid=rid,
            )

    return asyncio.run(run())


def test_every_route_refuses_a_request_without_the_key(vllm_engine):
    for method, path in [("GET", "/health"), ("POST", "/pause"), ("POST", "/update_weights"),
                         ("POST", "/init_weight_transfer_engine"), ("POST", "/collective_rpc"),
                         ("POST", "/v1/completions"), ("GET", "/weight_info")]:  # fmt: skip
        assert requests.request(method, vllm_engine.url + path, timeout=30).status_code == 401, path
    assert requests.get(vllm_engine.url + "/health", headers=vllm_engine.headers, timeout=30).ok


def test_completion_body_parsed_and_answered_by_vllms_serving_classes(vllm_engine):
    out = _sample(vllm_engine, [5, 6, 7], tokens=4)
    assert len(out.output_ids) == len(out.logprobs) == len(out.token_versions) == 4
    assert out.finish_reason == "length" and out.prompt_tokens == 3
    assert all(lp <= 0 for lp in out.logprobs)
    log = vllm_engine.get("/harness/log")
    assert "generate cmpl-r1-0" in log["log"]  # the name abort_request uses
    assert log["logprobs_mode"] == "processed_logprobs"  # after temperature, as parsed by vLLM


def _sender(engine, **cfg):
    sender = WeightSender(WeightSyncConfig(backend="gloo", timeout_s=120, **cfg), device="cpu")
    sender.connect(
        [EngineEndpoint("vllm-0", engine.url, engine.key, world_size=engine.tp_size, api="vllm")]
    )
    return sender


def _publish_and_check(engine, version, pause_mode):
    from transformers import AutoModelForCausalLM

    sender = _sender(engine, pause_mode=pause_mode, bucket_mb=0.05)
    try:
        model = AutoModelForCausalLM.from_pretrained(engine.argv[engine.argv.index("serve") + 1])
        torch.manual_seed(version)
        state = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        metrics = sender.publish(iter(state.items()), version, verify=True)
        assert metrics.num_buckets > 1  # bucketed: several packed chunks
        for rank in engine.rank_weights():
            for name, tensor in state.items():
                assert torch.equal(torch.tensor(rank[name]), tensor.flatten()), name
        assert engine.get("/weight_info")["weight_version"] == str(version)
    finally:
        sender.close()
    return engine.get("/harness/log")["log"]


def test_weight_update_sequence_tp1_bit_for_bit(vllm_engine):
    log = _publish_and_check(vllm_engine, 1, "abort")
    order = [e.split()[0] for e in log if not e.startswith(("generate", "abort"))]
    start = order.index("init_weight_transfer_engine")
    assert order[start : start + 3] == [
        "init_weight_transfer_engine",
        "pause",
        "start_weight_update",
    ]
    assert order[-4:] == ["finish_weight_update", "reset_prefix_cache", "resume", "shutdown_weight_transfer_engine"]  # fmt: skip


def test_weight_update_sequence_tp2_in_place_keeps_requests(vllm_engine_tp2):
    log = _publish_and_check(vllm_engine_tp2, 2, "in_place")
    assert "pause keep" in log and "reset_prefix_cache" not in log
    assert "--no-enable-prefix-caching" in vllm_engine_tp2.argv


def test_in_place_update_splits_a_sequence_into_version_spans(vllm_engine_tp2):
    engine = vllm_engine_tp2
    before = int(engine.get("/weight_info")["weight_version"])
    engine.post("/harness/hold?after=3")  # the request stops after 3 tokens until released

    async def run():
        async with _client(engine) as client:
            params = {"max_new_tokens": 8, "temperature": 1.0}
            task = asyncio.ensure_future(client.generate_sample([5, 6], params, rid="span"))
            await asyncio.to_thread(engine.wait_held, "span")
            await asyncio.to_thread(_publish_and_check, engine, before + 1, "in_place")
            await asyncio.to_thread(engine.post, "/harness/release")
            return await task

    out = asyncio.run(run())
    assert out.finish_reason == "length"
    assert out.token_versions == [before] * 3 + [before + 1] * 5
    assert out.weight_version == str(before + 1)


def test_abort_pause_ends_a_request_and_a_piece_sent_while_paused_waits(vllm_engine):
    engine = vllm_engine
    engine.post("/harness/hold?after=3")

    async def run():
        async with _client(engine) as client:
            params = {"max_new_tokens": 8, "temperature": 1.0}
            task = asyncio.ensure_future(client.generate_sample([5, 6], params, rid="ab"))
            await asyncio.to_thread(engine.wait_held, "ab")
            await client.pause_generation("retract")  # vLLM has no retract: abort
            await asyncio.to_thread(engine.post, "/harness/release")
            first = await task
            rest = {**params, "max_new_tokens": 8 - len(first.output_ids)}
            piece = [5, 6, *first.output_ids]  # as the sample runner resubmits it
            second = asyncio.ensure_future(client.generate_sample(piece, rest, rid="ab2"))
            while (
                "rejected cmpl-ab2-0"
                not in (await asyncio.to_thread(engine.get, "/harness/log"))["log"]
            ):
                await asyncio.sleep(0.05)  # vLLM answers 503 while paused; the client waits
            assert not second.done()
            await client.continue_generation()
            return first, await second

    first, second = asyncio.run(run())
    assert first.finish_reason == "abort" and len(first.output_ids) == 3
    assert second.finish_reason == "length" and len(second.output_ids) == 5
    assert "pause abort" in engine.get("/harness/log")["log"]


def test_abort_request_by_rid_ends_that_request_through_vllms_abort_route(vllm_engine):
    engine = vllm_engine
    engine.post("/harness/hold?after=2")

    async def run():
        async with _client(engine) as client:
            params = {"max_new_tokens": 8, "temperature": 1.0}
            task = asyncio.ensure_future(client.generate_sample([5, 6], params, rid="gone"))
            await asyncio.to_thread(engine.wait_held, "gone")
            await client.abort_request("gone")  # the runner's call for a request it gave up on
            await asyncio.to_thread(engine.post, "/harness/release")
            return await task

    out = asyncio.run(run())
    assert out.finish_reason == "abort" and len(out.output_ids) == 2
    assert "abort ['cmpl-gone-0']" in engine.get("/harness/log")["log"]


def test_profiling_a_vllm_engine_is_refused_by_vllm_without_a_profiler_config(vllm_engine):
    from rollout_fleet.client import EngineError

    async def run():
        async with _client(vllm_engine) as client:
            await client.start_profile("/tmp/unused")

    with pytest.raises(EngineError) as refused:  # the roles log it: profiling is best effort
        asyncio.run(run())
    assert refused.value.status == 404


def test_memory_release_and_resume_reach_sleep_and_wake_up(vllm_engine):
    async def run():
        async with _client(vllm_engine) as client:
            await client.release_memory_occupation(None)
            await client.resume_memory_occupation(["weights", "cuda_graph"])
            await client.release_memory_occupation(["kv_cache"])
            await client.resume_memory_occupation(None)

    asyncio.run(run())
    sleep = vllm_engine.get("/harness/log")["sleep"]
    assert sleep[-4:] == [["sleep", 2, "abort"], ["wake_up", ["weights"]], ["sleep", 1, "abort"], ["wake_up", ["weights", "kv_cache"]]]  # fmt: skip


def test_lora_adapter_by_path_reaches_vllms_lora_route(vllm_engine_tp2, tmp_path):
    from weight_sync.engine_api import weight_client

    endpoint = EngineEndpoint("vllm-0", vllm_engine_tp2.url, vllm_engine_tp2.key, world_size=2, api="vllm")  # fmt: skip
    client = weight_client(endpoint, 60)
    try:
        client.load_lora_adapter("fleetrl-policy-v3", str(tmp_path))
        client.set_weight_version("3")
        assert vllm_engine_tp2.get("/harness/log")["loras"] == {"fleetrl-policy-v3": str(tmp_path)}
        assert vllm_engine_tp2.get("/weight_info")["weight_version"] == "3"
        assert "fleetrl-policy-v3" in _served_models(vllm_engine_tp2)
        client.unload_lora_adapter("fleetrl-policy-v3")
    finally:
        client.close()
    assert "fleetrl-policy-v3" not in _served_models(vllm_engine_tp2)


def _served_models(engine) -> list[str]:
    return [m["id"] for m in engine.get("/v1/models")["data"]]
