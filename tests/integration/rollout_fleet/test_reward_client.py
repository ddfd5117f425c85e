"""RewardModelClient against a real reward server (the embedded engine on loopback) and, for
hostile behaviour only, aiohttp servers of the test's own.

Proves: scores come back one per input, in order, equal to the server's own single-input
scores, in ``/classify`` requests of at most ``batch_size`` (never ``/v1/classify``) with
the bearer key; a refused connection, an HTTP 500, a hung server (timeout), NaN / null /
inf scores and a reply with the wrong item count each fail over to the next server and
are counted; with only hostile servers the batch fails after ``max_attempts`` with a
``RewardServerError`` naming every server and cause; a 4xx input error fails at once; an
attempt that finds no server waits for ``set_servers``; a wrong key is refused.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_fleet.engine.reward_server import RewardEngine
from rollout_fleet.rewards.model_client import RewardModelClient, RewardServerError

KEY = "reward-key"
INPUTS = [[10 + i, 11, 12 + (i % 5)] + [3] * (i % 4) for i in range(11)]


@pytest.fixture(scope="module")
def real_server(tiny_reward_dir):
    """A real reward server with the key; the single-input scores the client must match."""
    eng = RewardEngine(str(tiny_reward_dir), engine_id="rm-client", api_key=KEY)
    url = eng.start_server()

    async def singles() -> list[float]:
        client = make_client({"real": url}, batch_size=1)
        try:
            return [(await client.score([ids]))[0] for ids in INPUTS]
        finally:
            await client.aclose()

    yield url, asyncio.run(singles()), eng
    eng.stop()


def make_client(servers: dict[str, str], **overrides) -> RewardModelClient:
    settings = dict(
        api_key=KEY, batch_size=4, request_timeout_s=5.0, max_attempts=3, retry_backoff_s=0.01
    )
    settings.update(overrides)
    return RewardModelClient(servers, **settings)


class Hostile:
    """An aiohttp server of the test's own whose /classify answers with ``reply(n_items)``."""

    def __init__(self, reply: Callable[[int], web.StreamResponse]) -> None:
        self.reply = reply
        self.calls: list[str] = []
        self.server: TestServer | None = None

    async def __aenter__(self) -> str:
        async def handle(request: web.Request):
            self.calls.append(request.path)
            body = await request.json()
            return await self.reply(len(body["input_ids"]))

        app = web.Application()
        app.router.add_post("/classify", handle)
        self.server = TestServer(app)
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def __aexit__(self, *exc) -> None:
        await self.server.close()


def raw(text: str):
    async def reply(n: int) -> web.Response:
        return web.Response(text=text.replace("N", str(n)), content_type="application/json")

    return reply


def items(value: str):
    """A reply of the right length whose every score is the JSON literal ``value``."""

    async def reply(n: int) -> web.Response:
        body = "[" + ",".join(f'{{"embedding": [{value}], "meta_info": {{}}}}' for _ in range(n)) + "]"  # fmt: skip
        return web.Response(text=body, content_type="application/json")

    return reply


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_scores_in_order_in_batches_of_batch_size_with_the_key(real_server):
    url, expected, eng = real_server
    seen: list[int] = []

    async def run() -> list[float]:
        client = make_client({"real": url}, batch_size=4)
        before = eng.worker.requests
        try:
            scores = await client.score(INPUTS)
            seen.append(eng.worker.requests - before)
            assert await client.score([]) == []
            return scores, client.stats()
        finally:
            await client.aclose()

    scores, stats = asyncio.run(run())
    assert scores == pytest.approx(expected, abs=1e-5)
    assert seen == [3]  # 11 inputs in batches of at most 4: 3 requests
    assert stats["reward_model/requests"] == 3 and stats["reward_model/items"] == 11
    assert stats["reward_model/failures"] == 0 and stats["reward_model/retries"] == 0
    assert stats["reward_model/latency_s"] > 0


@pytest.mark.parametrize(
    ("behaviour", "counter"),
    [
        (items("NaN"), "bad_replies"),  # a NaN literal: not JSON
        (items('"0.5"'), "bad_replies"),  # a score that is not a number
        (items("1e999"), "bad_replies"),  # inf
        (raw("[]"), "bad_replies"),  # the wrong number of items
        (raw('{"error": {"message": "boom"}}'), "bad_replies"),  # not a list
    ],
)
def test_a_bad_reply_fails_over_to_the_next_server_and_is_counted(real_server, behaviour, counter):
    url, expected, _ = real_server

    async def run():
        hostile = Hostile(behaviour)
        async with hostile as bad_url:
            # 6 batches in flight together: the least loaded server takes each next one
            client = make_client({"bad": bad_url, "real": url}, batch_size=2)
            try:
                return await client.score(INPUTS), client.stats(), len(hostile.calls)
            finally:
                await client.aclose()

    scores, stats, bad_calls = asyncio.run(run())
    assert scores == pytest.approx(expected, abs=1e-5)
    assert bad_calls >= 1 and stats[f"reward_model/{counter}"] == bad_calls
    assert stats["reward_model/failovers"] == bad_calls == stats["reward_model/retries"]
    assert stats["reward_model/failures"] == 0 and stats["reward_model/items"] == len(INPUTS)


def test_only_bad_servers_raise_after_max_attempts_naming_each_and_counted():
    async def run():
        async with Hostile(items("true")) as nan_url, Hostile(raw("[]")) as short_url:
            client = make_client({"nan": nan_url, "short": short_url}, max_attempts=4)
            try:
                with pytest.raises(RewardServerError) as caught:
                    await client.score(INPUTS[:3])
                return caught.value, client.stats()
            finally:
                await client.aclose()

    err, stats = asyncio.run(run())
    assert sorted(err.servers) == ["nan", "short"] and len(err.causes) == 4
    assert "score True, not a number" in str(err) and "0 items for a batch of 3" in str(err)
    assert stats["reward_model/bad_replies"] == 4 and stats["reward_model/failures"] == 1
    assert stats["reward_model/items"] == 0


def test_a_null_score_is_nan_for_its_input_alone_with_no_retry(real_server):
    """null is how a server's JSON writes a NaN or inf score: that input's sample fails."""
    url, _, _ = real_server

    async def run():
        async with Hostile(items("null")) as nan_url:
            client = make_client({"nan": nan_url})
            try:
                return await client.score(INPUTS[:3]), client.stats()
            finally:
                await client.aclose()

    scores, stats = asyncio.run(run())
    assert len(scores) == 3 and all(math.isnan(s) for s in scores)
    assert stats["reward_model/retries"] == 0 and stats["reward_model/bad_replies"] == 0


def test_refused_500_and_hung_servers_fail_over_and_the_timeout_is_counted(real_server):
    url, expected, _ = real_server

    async def hang(n: int) -> web.Response:
        await asyncio.sleep(60)
        return web.Response(text="[]")

    async def error(n: int) -> web.Response:
        return web.Response(status=500, text="scheduler died")

    async def run():
        hung, failing = Hostile(hang), Hostile(error)
        async with hung as hung_url, failing as error_url:
            servers = {"hung": hung_url, "500": error_url, "dead": closed_port_url(), "real": url}
            client = make_client(servers, batch_size=2, request_timeout_s=1.0, max_attempts=4)
            try:
                scores = await client.score(INPUTS)
                return scores, client.stats(), len(hung.calls), len(failing.calls)
            finally:
                await client.aclose()

    scores, stats, hung_calls, error_calls = asyncio.run(run())
    assert scores == pytest.approx(expected, abs=1e-5)
    assert hung_calls >= 1 and error_calls >= 1
    assert stats["reward_model/timeouts"] == hung_calls
    assert stats["reward_model/failovers"] == stats["reward_model/retries"] >= hung_calls + error_calls  # fmt: skip
    assert stats["reward_model/failures"] == 0 and stats["reward_model/items"] == len(INPUTS)


def test_an_input_the_server_refuses_fails_at_once_without_retries(real_server):
    url, _, _ = real_server

    async def run():
        client = make_client({"real": url, "other": url + "/"}, max_attempts=4)
        try:
            with pytest.raises(RewardServerError, match="outside the vocabulary") as caught:
                await client.score([[1, 2], [10**6]])
            return caught.value, client.stats()
        finally:
            await client.aclose()

    err, stats = asyncio.run(run())
    assert len(err.causes) == 1 and "HTTP 400" in err.causes[0]
    assert stats["reward_model/retries"] == 0 and stats["reward_model/failures"] == 1


def test_a_wrong_key_is_refused_by_the_server(real_server):
    url, _, _ = real_server

    async def run():
        client = make_client({"real": url}, api_key="wrong")
        try:
            with pytest.raises(RewardServerError, match="HTTP 401"):
                await client.score([[1, 2]])
        finally:
            await client.aclose()

    asyncio.run(run())


def test_an_attempt_without_servers_waits_for_set_servers(real_server):
    url, expected, _ = real_server

    async def run():
        client = make_client({}, request_timeout_s=10.0)
        try:
            pending = asyncio.ensure_future(client.score(INPUTS[:2]))
            await asyncio.sleep(0.2)
            assert not pending.done()
            client.set_servers({"late": url})
            return await asyncio.wait_for(pending, 30)
        finally:
            await client.aclose()

    assert asyncio.run(run()) == pytest.approx(expected[:2], abs=1e-5)


def test_no_server_at_all_is_an_error_after_the_attempts():
    async def run():
        client = make_client({}, request_timeout_s=0.2, max_attempts=2)
        try:
            with pytest.raises(RewardServerError, match="no reward server available"):
                await client.score([[1]])
        finally:
            await client.aclose()

    asyncio.run(run())
