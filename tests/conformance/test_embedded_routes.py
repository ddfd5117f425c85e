"""The embedded engine's HTTP surface against SGLang's own app and request types.

Every route of ``EmbeddedEngine.app`` must be a route of SGLang's FastAPI app
with the same method (the embedded engine has no route a real server lacks), and
``/update_weights_from_disk`` must take the body SGLang's
``UpdateWeightFromDiskReqInput`` describes and answer with the fields of
``UpdateWeightFromDiskReqOutput`` (SGLang's route writes them as a JSON object).
"""

from __future__ import annotations

import json

import msgspec
import pytest
import requests

from rollout_fleet import protocol as P
from rollout_fleet.engine.server import EmbeddedEngine

# BaseReq's IPC routing fields: SGLang fills them inside the server, never from a body
ROUTING_FIELDS = {"rid", "http_worker_ipc"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = EmbeddedEngine(tiny_model_dir, engine_id="routes", max_running_requests=4)
    url = eng.start_server()
    yield eng, url
    eng.stop()


def test_every_embedded_route_is_an_sglang_route_with_its_method(engine):
    from sglang.srt.entrypoints import http_server

    sglang_routes = {
        (method, route.path)
        for route in http_server.app.routes
        for method in getattr(route, "methods", ()) or ()
    }
    ours = {
        (route.method, route.resource.canonical)
        for route in engine[0].app(None).router.routes()
        if route.method != "HEAD"  # aiohttp adds HEAD beside every GET
    }
    assert ours and ours <= sglang_routes, sorted(ours - sglang_routes)
    assert ("POST", "/update_weights_from_disk") in ours


def test_disk_update_mirror_has_sglangs_fields_and_defaults():
    from sglang.srt.managers import io_struct as io

    theirs = {
        f.name: f.default
        for f in msgspec.structs.fields(io.UpdateWeightFromDiskReqInput)
        if f.name not in ROUTING_FIELDS
    }
    ours = {f.name: f.default for f in msgspec.structs.fields(P.UpdateWeightsFromDiskRequest)}
    assert ours == theirs


def _as_sglang_output(reply: dict):
    """SGLang's output struct from our reply: the same field names, each of its type."""
    from sglang.srt.managers import io_struct as io

    fields = {f.name: f.type for f in msgspec.structs.fields(io.UpdateWeightFromDiskReqOutput)}
    assert set(reply) == set(fields) - ROUTING_FIELDS
    out = io.UpdateWeightFromDiskReqOutput(**reply)
    assert isinstance(out.success, bool) and isinstance(out.message, str)
    assert isinstance(out.num_paused_requests, int)
    return out


def test_sglangs_request_body_is_taken_and_the_reply_parses_as_sglangs_output(
    engine, tiny_model_dir
):
    from sglang.srt.managers import io_struct as io

    _, url = engine
    request = io.UpdateWeightFromDiskReqInput(model_path=str(tiny_model_dir), weight_version="3")
    body = {
        f.name: getattr(request, f.name)
        for f in msgspec.structs.fields(request)
        if f.name not in ROUTING_FIELDS
    }
    reply = requests.post(f"{url}/update_weights_from_disk", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    out = _as_sglang_output(reply.json())
    assert out.success is True and "Weight version updated to 3" in out.message
    assert requests.get(f"{url}/model_info", timeout=5).json()["weight_version"] == "3"
    failed = requests.post(
        f"{url}/update_weights_from_disk", json={**body, "model_path": "/no/such"}, timeout=30
    )
    assert failed.status_code == 400
    refused = _as_sglang_output(failed.json())
    assert refused.success is False and "/no/such" in refused.message


def test_our_clients_disk_update_body_is_valid_for_sglangs_route(monkeypatch):
    """What ``EngineClient.update_weights_from_disk`` sends, parsed as SGLang's route parses it
    (pydantic over ``UpdateWeightFromDiskReqInput``; it ignores unknown keys, so the keys are
    checked against its fields too)."""
    import pydantic
    from sglang.srt.managers import io_struct as io

    from weight_sync.engine_client import EngineClient, EngineEndpoint

    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        EngineClient, "call", lambda self, path, payload=None, **_: sent.append((path, payload))
    )
    client = EngineClient(EngineEndpoint("e", "http://127.0.0.1:1"), timeout_s=1)
    client.update_weights_from_disk("/ckpt/step_8", weight_version="8")
    client.update_weights_from_disk("/ckpt/step_9")
    fields = {f.name for f in msgspec.structs.fields(io.UpdateWeightFromDiskReqInput)}
    adapter = pydantic.TypeAdapter(io.UpdateWeightFromDiskReqInput)
    for path, body in sent:
        assert path == "/update_weights_from_disk" and set(body) <= fields - ROUTING_FIELDS
        parsed = adapter.validate_python(body)
        assert parsed.model_path == body["model_path"] and parsed.abort_all_requests is False
    assert adapter.validate_python(sent[0][1]).weight_version == "8"
    assert adapter.validate_python(sent[1][1]).weight_version is None


def test_the_profile_body_mirrors_sglangs_and_our_clients_body_parses_as_sglangs_route():
    """``/start_profile`` takes SGLang's ``ProfileReq`` (its route parses the body with
    pydantic into it): our mirror has its fields and defaults, and what
    ``rollout_fleet.client.EngineClient.start_profile`` sends is a valid ``ProfileReq``."""
    import asyncio

    import pydantic
    from sglang.srt.managers import io_struct as io

    from rollout_fleet.client import EngineClient

    theirs = {
        f.name: f.default
        for f in msgspec.structs.fields(io.ProfileReq)
        if f.name not in ROUTING_FIELDS | {"req_type"}  # req_type: set by the route itself
    }
    ours = {f.name: f.default for f in msgspec.structs.fields(P.ProfileRequest)}
    assert ours == theirs
    sent: list[dict] = []

    async def capture(self, method, endpoint, body=None, **_):
        sent.append(body)
        return ""

    client = EngineClient("http://127.0.0.1:1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineClient, "_request", capture)
        asyncio.run(client.start_profile("/runs/x/profile/step_2", "engine_", gpu=True))
    parsed = pydantic.TypeAdapter(io.ProfileReq).validate_python(sent[0])
    assert parsed.output_dir == "/runs/x/profile/step_2" and parsed.activities == ["CPU", "GPU"]
    assert parsed.profile_prefix == "engine_" and set(sent[0]) <= set(theirs)


def test_top_logprobs_reply_is_what_sglangs_tokenizer_manager_builds(engine, tiny_model_dir):
    """``top_logprobs_num`` on ``/generate``, the body validated as SGLang's ``GenerateReqInput``:
    ``meta_info.output_top_logprobs`` (plain and streamed) is exactly what SGLang's
    ``TokenizerManager.detokenize_top_logprobs_tokens`` makes of those values and ids, one row
    per output token, highest first; greedy, the sampled token leads its row with its logprob."""
    import pydantic
    from sglang.srt.managers import io_struct as io
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from transformers import AutoTokenizer

    _, url = engine
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 4,
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}  # fmt: skip
    pydantic.TypeAdapter(io.GenerateReqInput).validate_python(body)
    manager = object.__new__(TokenizerManager)  # only its detokenizing methods are used
    manager.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = requests.post(f"{url}/generate", json=body, timeout=60).json()
    events = requests.post(f"{url}/generate", json={**body, "stream": True}, timeout=60)
    last = [line[6:] for line in events.text.splitlines() if line.startswith("data: {")][-1]
    for meta in (reply["meta_info"], json.loads(last)["meta_info"]):
        rows = meta["output_top_logprobs"]
        values = [[entry[0] for entry in row] for row in rows]
        ids = [[entry[1] for entry in row] for row in rows]
        theirs = TokenizerManager.detokenize_top_logprobs_tokens(manager, values, ids, True)
        assert rows == [[list(entry) for entry in row] for row in theirs]
        assert len(rows) == 6 and all(v == sorted(v, reverse=True) for v in values)
        for (lp, tid, _), row in zip(meta["output_token_logprobs"], rows, strict=True):
            assert row[0][:2] == [lp, tid]


def test_a_groups_batched_request_is_sglangs_batch_form_answered_in_order(engine):
    """``EngineClient.generate_batch`` (``rollout.batch_groups``): its body validates as SGLang's
    ``GenerateReqInput`` in batch form (a list of ``input_ids``, one ``rid`` each, which
    SGLang's ``normalize_batch_and_arguments`` keeps per item), and the engine answers one reply
    per prompt, in order, each under its own rid; greedy, equal prompts get equal outputs."""
    import asyncio

    import pydantic
    from sglang.srt.managers import io_struct as io

    from rollout_fleet.client import EngineClient

    _, url = engine
    prompts, rids = [[5, 6, 7], [5, 6, 7], [8, 9]], ["g/0.0.0", "g/1.0.0", "g/2.0.0"]
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    sent: list[dict] = []
    original = EngineClient._request

    async def capture(self, method, endpoint, body=None, **kwargs):
        sent.append(body)
        return await original(self, method, endpoint, body, **kwargs)

    async def call():
        async with EngineClient(url) as client:
            return await client.generate_batch(prompts, params, rids=rids)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineClient, "_request", capture)
        outputs = asyncio.run(call())
    parsed = pydantic.TypeAdapter(io.GenerateReqInput).validate_python(sent[0])
    parsed.normalize_batch_and_arguments()
    assert parsed.batch_size == 3 and parsed.rid == rids and parsed.return_logprob == [True] * 3
    assert [o.rid for o in outputs] == rids
    assert all(len(o.output_ids) == len(o.logprobs) == 4 for o in outputs)
    assert outputs[0].output_ids == outputs[1].output_ids  # greedy, the same prompt
    assert [o.prompt_tokens for o in outputs] == [3, 3, 2]
