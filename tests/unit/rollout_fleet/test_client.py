"""EngineClient: response parsing (embedded engine and plain SGLang), error shape, retry policy."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_fleet.client import (
    EngineClient,
    EngineError,
    SyncEngineClient,
    parse_generate_response,
)

SGLANG_RESPONSE = {
    "text": "ab",
    "output_ids": [11, 12, 2],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "weight_version": "7",
        "e2e_latency": 0.1,
        "output_token_logprobs": [[-0.5, 11, None], [-1.0, 12, None], [-0.1, 2, None]],
    },
}


def test_parse_plain_sglang_tags_every_token_with_the_request_weight_version():
    out = parse_generate_response(SGLANG_RESPONSE)
    assert out.output_ids == [11, 12, 2] and out.logprobs == [-0.5, -1.0, -0.1]
    assert out.token_versions == [7, 7, 7] and out.weight_version == "7"
    assert out.finish_reason == "stop" and out.matched_stop == 2 and out.prompt_tokens == 4


def test_parse_turns_weight_versions_spans_into_per_token_versions():
    spans = [{"version": "6", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 3}]
    resp = {
        **SGLANG_RESPONSE,
        "meta_info": {**SGLANG_RESPONSE["meta_info"], "weight_versions": spans},
    }
    assert parse_generate_response(resp).token_versions == [6, 6, 7]


def test_parse_rejects_inconsistent_or_incomplete_responses():
    with pytest.raises(ValueError, match="return_logprob"):
        parse_generate_response({**SGLANG_RESPONSE, "meta_info": {"weight_version": "1"}})
    for spans in (
        [{"version": "1", "start": 0, "end": 1}],  # covers 1 of 3 tokens
        [{"version": "1", "start": 1, "end": 3}],  # does not start at token 0
        [{"version": "x", "start": 0, "end": 3}],  # not an integer version
    ):
        bad = {
            **SGLANG_RESPONSE,
            "meta_info": {**SGLANG_RESPONSE["meta_info"], "weight_versions": spans},
        }
        with pytest.raises(ValueError, match="weight_versions"):
            parse_generate_response(bad)
    with pytest.raises(ValueError, match="meta_info"):
        parse_generate_response({"text": ""})


class FlakyServer:
    """Answers 503 to the first ``failures`` calls of every endpoint, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.hits: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        if self.hits[request.path] <= self.failures:
            return web.json_response({"error": {"message": "warming up"}}, status=503)
        if request.path == "/model_info":
            return web.json_response({"weight_version": "5"})
        return web.json_response(SGLANG_RESPONSE)


async def _with_server(failures: int, body):
    flaky = FlakyServer(failures)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", flaky.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with EngineClient(str(server.make_url("")).rstrip("/"), retries=2) as client:
            client_result = await body(client)
    finally:
        await server.close()
    return client_result, flaky.hits


def test_idempotent_calls_retry_on_5xx_but_generate_does_not(monkeypatch):
    monkeypatch.setattr("rollout_fleet.client.RETRY_BACKOFF_S", 0.0)
    version, hits = asyncio.run(_with_server(2, lambda c: c.get_weight_version()))
    assert version == "5" and hits["/model_info"] == 3

    async def gen(client):
        with pytest.raises(EngineError) as err:
            await client.generate([1, 2], {"max_new_tokens": 1})
        return err.value

    err, hits = asyncio.run(_with_server(1, gen))
    assert hits["/generate"] == 1
    assert err.status == 503 and err.endpoint == "/generate" and "warming up" in str(err)


def test_connection_refused_is_an_engine_error_without_status(monkeypatch):
    monkeypatch.setattr("rollout_fleet.client.RETRY_BACKOFF_S", 0.0)

    async def scenario():
        async with EngineClient("http://127.0.0.1:9", retries=1, timeout_s=5) as client:
            assert await client.health() is False
            with pytest.raises(EngineError) as err:
                await client.generate([1], {})
            return err.value

    err = asyncio.run(scenario())
    assert (
        err.status is None
        and "cannot connect" in err.message
        and err.engine_url == "http://127.0.0.1:9"
    )


def test_sync_facade_calls_the_async_client(monkeypatch):
    async def start():
        flaky = FlakyServer(0)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", flaky.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        return server

    loop = asyncio.new_event_loop()
    import threading

    server = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = SyncEngineClient(str(server.make_url("")).rstrip("/"))
        assert client.get_weight_version() == "5"
        assert client.generate([1], {"max_new_tokens": 1})["meta_info"]["id"] == "r1"
        client.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
