"""fleetrl's rollout engine client against SGLang's own HTTP app.

Requests are parsed by SGLang's route handlers into its io_struct types (an
unknown field or a bad type is SGLang's 400, not ours), auth is SGLang's
middleware, and the per-token versions come from SGLang's own
``weight_versions`` spans. A weight update lands mid-sequence exactly as a GPU
run's in-place update does: fleetrl's WeightSender pauses, begins, broadcasts,
ends and continues.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_fleet.client import (
    EngineClient,
    EngineError,
    SyncEngineClient,
    parse_generate_response,
)
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import EngineEndpoint, WeightSender
from weight_sync.sources import module_named_tensors

pytestmark = pytest.mark.timeout(600)
PROMPT = [5, 6, 7, 8]
LONG = 480  # still running when the update lands (the tiny model's context is 512)


def tensors(model_dir, shift: float) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(shift)
    return [(n, t.detach().clone()) for n, t in module_named_tensors(model)]


@pytest.fixture(scope="module")
def synced(sglang_engine, tiny_model_dir):
    """The engine after fleetrl's initial sync (version 0), as every training run starts."""
    config = WeightSyncConfig(backend="gloo", pause_mode="in_place", timeout_s=60)
    endpoint = EngineEndpoint("sglang", sglang_engine.url, sglang_engine.api_key)
    with WeightSender(config) as sender:
        sender.connect([endpoint])
        sender.publish(iter(tensors(tiny_model_dir, 0.0)), 0)
        yield sglang_engine, sender


def test_generate_parses_into_tokens_logprobs_and_versions(synced):
    engine, _ = synced
    client = SyncEngineClient(engine.url, api_key=engine.api_key)
    try:
        assert client.get_weight_version() == "0"  # GET /model_info
        resp = client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0})
        out = parse_generate_response(resp)
        assert len(out.output_ids) == 6 and len(out.logprobs) == 6
        assert all(lp <= 0.0 for lp in out.logprobs)
        assert out.token_versions == [0] * 6 and out.finish_reason == "length"
        # ignore_eos: a sampled end-of-sequence would end a response early (flaky lengths)
        batch = client.generate(
            [PROMPT, PROMPT[:2]], {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
        )
        assert isinstance(batch, list) and len(batch) == 2
        assert all(parse_generate_response(r).token_versions == [0] * 3 for r in batch)
    finally:
        client.close()


def test_a_streamed_piece_from_sglangs_server_equals_the_unstreamed_one(synced):
    """``generate_sample(on_partial=)`` reads SGLang's own ``/generate`` stream (its
    ``TokenizerManager`` writes the events): every event before the last is the output so far,
    one token more each time, and the piece is what an unstreamed request returns."""
    engine, _ = synced
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def both():
        async with EngineClient(engine.url, api_key=engine.api_key) as client:
            partials: list = []
            streamed = await client.generate_sample(PROMPT, params, on_partial=partials.append)
            return partials, streamed, await client.generate_sample(PROMPT, params)

    partials, streamed, plain = asyncio.run(both())
    assert [len(p.output_ids) for p in partials] == [1, 2, 3, 4, 5]
    assert all(p.output_ids == plain.output_ids[: len(p.output_ids)] for p in partials)
    assert all(p.token_versions == [0] * len(p.output_ids) for p in partials)
    assert (streamed.output_ids, streamed.logprobs, streamed.token_versions) == (
        plain.output_ids, plain.logprobs, plain.token_versions)  # fmt: skip
    assert streamed.finish_reason == "length"


def test_sglang_refuses_what_its_io_structs_do_not_define(synced):
    engine, _ = synced
    client = SyncEngineClient(engine.url, api_key=engine.api_key)
    unauthenticated = SyncEngineClient(engine.url)
    try:
        with pytest.raises(EngineError) as err:
            client.generate(PROMPT, {"max_new_tokens": 2, "not_a_sampling_field": 1})
        assert err.value.status == 400
        with pytest.raises(EngineError) as err:
            unauthenticated.generate(PROMPT, {"max_new_tokens": 2})
        assert err.value.status == 401
    finally:
        client.close()
        unauthenticated.close()


def test_in_place_update_mid_sequence_gives_each_token_its_version(synced, tiny_model_dir):
    engine, sender = synced
    client = SyncEngineClient(engine.url, api_key=engine.api_key, timeout_s=300)
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            resp=client.generate(PROMPT, {"max_new_tokens": LONG, "temperature": 0.0})
        )
    )
    try:
        worker.start()
        time.sleep(0.5)
        client.pause_generation("in_place")
        assert worker.is_alive(), "the request finished before the update could land"
        sender.publish(iter(tensors(tiny_model_dir, 0.01)), 1)  # pause, begin, ..., continue
        worker.join(timeout=300)
    finally:
        client.close()
    out = parse_generate_response(result["resp"])
    first_new = out.token_versions.index(1)
    assert 0 < first_new < LONG
    assert out.token_versions == [0] * first_new + [1] * (LONG - first_new)
    assert out.weight_version == "1"
