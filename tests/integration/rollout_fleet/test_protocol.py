"""EngineClient against the embedded engine, checked against SGLang's native API schema.

The expected field names and types are written out here from SGLang's
``io_struct.py`` (GenerateReqInput, SamplingParams, PauseGenerationReqInput,
AbortReq, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
DestroyWeightsUpdateGroupReqInput) and ``http_server.py`` responses, so a drift
in either the client's requests or the engine's responses fails here.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_fleet.client import EngineClient, EngineError, parse_generate_response
from rollout_fleet.engine.server import EmbeddedEngine

SGLANG_GENERATE_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "log_metrics",
    "image_data",
    "lora_path",
    "custom_logit_processor",
    "session_params",
}
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "json_schema",
    "regex",
    "ebnf",
}
SGLANG_REQUEST_FIELDS = {
    "/pause_generation": {"mode"},
    "/abort_request": {"rid", "abort_all"},
    "/init_weights_update_group": {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    },
    "/update_weights_from_distributed": {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
        "torch_empty_cache",
    },
    "/destroy_weights_update_group": {"group_name"},
}
META_TYPES = {
    "id": str,
    "finish_reason": dict,
    "prompt_tokens": int,
    "completion_tokens": int,
    "cached_tokens": int,
    "weight_version": str,
    "e2e_latency": float,
}


def check_generate_response(obj: dict, *, logprobs: bool) -> None:
    assert set(obj) >= {"text", "output_ids", "meta_info"}
    assert isinstance(obj["text"], str)
    assert all(isinstance(t, int) for t in obj["output_ids"])
    meta = obj["meta_info"]
    for key, typ in META_TYPES.items():
        assert isinstance(meta[key], typ), (key, meta[key])
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["completion_tokens"] == len(obj["output_ids"])
    if logprobs:
        entries = meta["output_token_logprobs"]
        assert len(entries) == len(obj["output_ids"])
        for (lp, tid, text), out_id in zip(entries, obj["output_ids"], strict=True):
            assert isinstance(lp, float) and lp <= 0 and tid == out_id and text is None
    else:
        assert "output_token_logprobs" not in meta
    n = len(obj["output_ids"])
    assert meta["weight_versions"] == ([{"version": "0", "start": 0, "end": n}] if n else [])


class Receiver:
    def init_group(self, *args, **kwargs):
        pass

    def receive(self, names, dtypes, shapes, group_name, load_format, load=None):
        named = [(n, torch.zeros(s)) for n, s in zip(names, shapes, strict=True)]
        return named if load is None else load(named)

    def destroy(self, group_name):
        pass


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = EmbeddedEngine(
        tiny_model_dir, engine_id="proto", max_running_requests=8, receiver_factory=Receiver
    )
    yield eng
    eng.stop()


def test_client_requests_and_engine_responses_follow_sglang_schema(engine):
    seen: list[tuple[str, dict | None]] = []

    @web.middleware
    async def record(request, handler):
        raw = await request.read()
        seen.append((request.path, __import__("json").loads(raw) if raw.strip() else None))
        return await handler(request)

    async def scenario():
        app = engine.app(None)
        app.middlewares.insert(0, record)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            async with EngineClient(str(server.make_url("")).rstrip("/")) as client:
                single = await client.generate(
                    [5, 6, 7], {"temperature": 0.0, "max_new_tokens": 4}, rid="one"
                )
                batch = await client.generate(
                    [[5, 6], [7, 8, 9]],
                    {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 3, "n": 2},
                )
                plain = await client.generate([5], {"max_new_tokens": 2}, return_logprob=False)
                info = await client.get_model_info()
                version = await client.get_weight_version()
                health = await client.health() and await client.health_generate()
                await client.pause_generation("in_place")
                await client.continue_generation()
                await client.abort_request(rid="nothing-running")
                flushed = await client.flush_cache()
                w = engine.runner.named_weights()["model.norm.weight"]
                init = await client.init_weights_update_group(
                    master_address="127.0.0.1",
                    master_port=1234,
                    rank_offset=1,
                    world_size=2,
                    group_name="g",
                    backend="gloo",
                )
                with pytest.raises(EngineError, match="must run between begin_weight_update"):
                    await client.update_weights_from_distributed(
                        names=["model.norm.weight"],
                        dtypes=["float32"],
                        shapes=[list(w.shape)],
                        group_name="g",
                        weight_version="3",
                    )
                await client.begin_weight_update()
                update = await client.update_weights_from_distributed(
                    names=["model.norm.weight"],
                    dtypes=["float32"],
                    shapes=[list(w.shape)],
                    group_name="g",
                    flush_cache=True,
                    weight_version="3",
                    load_format=None,
                )
                await client.end_weight_update()
                destroy = await client.destroy_weights_update_group("g")
                return single, batch, plain, info, version, health, flushed, init, update, destroy
        finally:
            await server.close()

    single, batch, plain, info, version, health, flushed, init, update, destroy = asyncio.run(
        scenario()
    )

    check_generate_response(single, logprobs=True)
    assert single["meta_info"]["id"] == "one"
    assert isinstance(batch, list) and len(batch) == 4
    for obj in batch:
        check_generate_response(obj, logprobs=True)
    assert batch[1]["meta_info"]["cached_tokens"] == 2  # second sample shared the prompt prefill
    check_generate_response(plain, logprobs=False)
    assert info["is_generation"] is True and isinstance(info["model_path"], str)
    assert version == "0" and health is True and "flushed" in flushed.lower()
    for reply in (init, update, destroy):
        assert set(reply) == {"success", "message"} and reply["success"] is True
    assert "3" in update["message"]

    for path, body in seen:
        if path == "/generate":
            assert set(body) <= SGLANG_GENERATE_FIELDS, body
            assert set(body["sampling_params"]) <= SGLANG_SAMPLING_FIELDS
        elif path in SGLANG_REQUEST_FIELDS:
            assert set(body) <= SGLANG_REQUEST_FIELDS[path], (path, body)
    paths = {p for p, _ in seen}
    assert {
        "/generate",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/model_info",
    } <= paths

    parsed = parse_generate_response(single)
    assert parsed.output_ids == single["output_ids"] and parsed.token_versions == [0] * 4
    assert parsed.finish_reason == "length" and parsed.prompt_tokens == 3
