"""Reward-model scoring against SGLang 0.5.23's own code: its ``/classify`` route, its
``EmbeddingReqInput``, its TokenizerManager embedding path and reply building, its API-key
middleware (the harness of ``sglang_engine`` serving the tiny reward model with
``--is-embedding``).

Proves:
- the client's ``/classify`` bodies (batch, and a batch of one) are parsed by SGLang's route
  into its ``EmbeddingReqInput`` and answered in SGLang's reply shape, built by SGLang's
  ``_handle_batch_output``; the client reads back the model's scores;
- the embedded reward engine's replies have the same shape and keys as SGLang's for the
  same request (batch and single, token ids and text), and the same scores;
- the embedded engine's request struct has the installed ``EmbeddingReqInput``'s field
  set and defaults, its routes are SGLang routes, its ``/model_info`` says what SGLang's
  says for the model (``is_generation`` false, architectures, model type);
- SGLang's API-key middleware refuses the client without the key (and with a wrong one);
- SGLang's ``/v1/classify`` applies a softmax, so a one-label model reads 1.0 there:
  the reason the client scores on ``/classify``.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import requests

from rollout_fleet import protocol as P
from rollout_fleet.engine.reward_server import RewardEngine
from rollout_fleet.rewards.model_client import RewardModelClient, RewardServerError
from tests.conformance.conftest import CONFORMANCE_API_KEY

BATCH = [[10, 11, 12, 13], [20, 21], [5, 6, 7, 8, 9, 10, 11, 12, 13], [30, 31, 32]]
TEXTS = ["2 + 2 = 4", "the answer is #### 5"]
# SGLang's meta_info varies per request in these; the rest must be equal
PER_REQUEST = {"id", "e2e_latency", "response_sent_to_client_ts", "weight_version"}


@pytest.fixture(scope="module")
def ours(tiny_reward_dir):
    eng = RewardEngine(str(tiny_reward_dir), engine_id="rm-conformance")
    url = eng.start_server()
    yield eng, url
    eng.stop()


def client_for(url: str, api_key: str | None = CONFORMANCE_API_KEY, **over) -> RewardModelClient:
    settings = dict(batch_size=3, request_timeout_s=30.0, max_attempts=2, retry_backoff_s=0.01)
    settings.update(over)
    return RewardModelClient({"sglang": url}, api_key=api_key, **settings)


def post(url: str, body: dict, key: str | None = CONFORMANCE_API_KEY, path="/classify"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + path, json=body, headers=headers, timeout=60)


def shape(item: dict) -> tuple:
    """What must agree between two replies to the same input: keys, types, fixed values."""
    meta = item["meta_info"]
    fixed = {k: v for k, v in meta.items() if k not in PER_REQUEST}
    types = {k: type(v).__name__ for k, v in meta.items()}
    return sorted(item), len(item["embedding"]), sorted(types.items()), sorted(fixed.items())


def test_the_clients_bodies_go_through_sglangs_route_and_come_back_as_scores(sglang_reward_engine, ours):  # fmt: skip
    eng, url = ours
    expected = [s[0] for s in eng.runner.score(BATCH)]
    sent: list[dict] = []

    async def run():
        client = client_for(sglang_reward_engine.url)
        original = client._attempt

        async def recording(server, batch, rids):
            sent.append({"input_ids": batch, "rid": rids})
            return await original(server, batch, rids)

        client._attempt = recording
        try:
            return await client.score(BATCH), await client.score(BATCH[:1]), client.stats()
        finally:
            await client.aclose()

    scores, single, stats = asyncio.run(run())
    assert scores == pytest.approx(expected, abs=1e-5) and single == pytest.approx(expected[:1], abs=1e-5)  # fmt: skip
    assert stats["reward_model/requests"] == 3 and stats["reward_model/failures"] == 0
    from sglang.srt.managers import io_struct as io

    fields = {f.name for f in dataclasses.fields(io.EmbeddingReqInput)}
    for body in sent:  # every key is one SGLang's EmbeddingReqInput has (its route ignores others)
        assert set(body) <= fields
        parsed = io.EmbeddingReqInput(**body)
        parsed.normalize_batch_and_arguments()
        assert not parsed.is_single and parsed.batch_size == len(body["input_ids"])
        assert parsed.rid == body["rid"] and len(set(parsed.rid)) == len(parsed.rid)


def test_our_replies_have_sglangs_shape_and_keys_for_the_same_requests(sglang_reward_engine, ours):  # fmt: skip
    _, url = ours
    for body in (
        {"input_ids": BATCH},
        {"input_ids": BATCH[2]},
        {"text": TEXTS},
        {"text": TEXTS[0]},
        {"input_ids": BATCH[:2], "rid": ["first", "second"]},
    ):
        theirs = post(sglang_reward_engine.url, body)
        mine = post(url, body, key=None)
        assert theirs.status_code == mine.status_code == 200, (theirs.text, mine.text)
        a, b = theirs.json(), mine.json()
        batched = isinstance(body.get("text"), list) or isinstance(body.get("input_ids", [0])[0], list)  # fmt: skip
        assert isinstance(a, list) == isinstance(b, list) == batched
        items_a, items_b = (a, b) if isinstance(a, list) else ([a], [b])
        assert [shape(x) for x in items_a] == [shape(x) for x in items_b]
        for x, y in zip(items_a, items_b, strict=True):
            assert x["embedding"] == pytest.approx(y["embedding"], abs=1e-5)
        if "rid" in body:
            assert [x["meta_info"]["id"] for x in items_a] == [x["meta_info"]["id"] for x in items_b] == body["rid"]  # fmt: skip


def test_our_request_struct_has_the_installed_embedding_req_inputs_fields_and_defaults():
    from sglang.srt.managers import io_struct as io

    def default(f):
        if f.default is not dataclasses.MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None

    theirs = {f.name: default(f) for f in dataclasses.fields(io.EmbeddingReqInput)}
    import msgspec

    mine = {f.name: f.default for f in msgspec.structs.fields(P.EmbeddingRequest)}
    assert mine == theirs


def test_our_routes_are_sglang_routes_and_model_info_agrees(sglang_reward_engine, ours):
    from sglang.srt.entrypoints import http_server

    eng, url = ours
    sglang_routes = {
        (method, route.path)
        for route in http_server.app.routes
        for method in getattr(route, "methods", ()) or ()
    }
    mine = {
        (r.method, r.resource.canonical)
        for r in eng.app(None).router.routes()
        if r.method != "HEAD"
    }
    assert mine <= sglang_routes, sorted(mine - sglang_routes)
    assert {("POST", "/classify"), ("PUT", "/classify"), ("POST", "/encode")} <= mine
    theirs = post_get(sglang_reward_engine.url + "/model_info")
    info = requests.get(url + "/model_info", timeout=10).json()
    assert set(info) <= set(theirs), set(info) - set(theirs)
    for key in ("is_generation", "architectures", "model_type", "preferred_sampling_params"):
        assert info[key] == theirs[key], key
    assert theirs["is_generation"] is False
    for path in ("/health", "/health_generate"):
        assert requests.get(sglang_reward_engine.url + path, timeout=60).status_code == 200
        assert requests.get(url + path, timeout=60).status_code == 200


def post_get(url: str) -> dict:
    return requests.get(url, headers={"Authorization": f"Bearer {CONFORMANCE_API_KEY}"}, timeout=30).json()  # fmt: skip


def test_sglangs_api_key_middleware_refuses_the_client_without_the_key(sglang_reward_engine):
    async def run(key):
        client = client_for(sglang_reward_engine.url, api_key=key, max_attempts=3)
        try:
            with pytest.raises(RewardServerError) as caught:
                await client.score(BATCH[:2])
            return caught.value
        finally:
            await client.aclose()

    for key in (None, "wrong-key"):
        err = asyncio.run(run(key))
        assert len(err.causes) == 1 and "HTTP 401" in err.causes[0]  # no retry: a key error
        assert err.servers == ["sglang"]


def test_sglangs_v1_classify_applies_a_softmax_so_a_one_label_model_reads_one(sglang_reward_engine):  # fmt: skip
    reply = post(sglang_reward_engine.url, {"input": TEXTS[0], "model": "rm"}, path="/v1/classify")
    assert reply.status_code == 200, reply.text
    assert reply.json()["data"][0]["probs"] == [1.0]
    native = post(sglang_reward_engine.url, {"text": TEXTS[0]})
    assert native.json()["embedding"][0] != pytest.approx(1.0)
