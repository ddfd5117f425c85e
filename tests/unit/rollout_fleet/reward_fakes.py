"""In-process fakes of reward-model servers and of their client, for the reward pipeline's tests.

``FakeRewardModelClient`` has the interface of ``rollout_fleet.rewards.model_client
.RewardModelClient``: ``score`` splits the inputs into batches of ``batch_size``, sends
each to a server, and on a dead, hung (timeout) or wrong-count reply tries the next server,
up to ``max_attempts``, then raises ``RewardServerError`` naming the servers tried; a
non-finite score is handed back for its sample, as the real client does. The servers
(``FakeRewardServer``) are plain objects found by URL in a ``FakeRewardFleet``;
each logs every item it scored, so a test can count items lost or scored twice.

``HttpRewardFleet`` is the same scenario over the wire: hostile aiohttp servers on
loopback answering ``/classify`` in SGLang's reply shape, scored through the REAL client
(``rollout_fleet.rewards.model_client``); the fault tests run on both where the real
client is present.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any


class RewardServerError(RuntimeError):
    """A batch that could not be scored (the interface's exception)."""


def length_score(ids: list[int]) -> float:
    """A deterministic stand-in for a reward model: longer inputs score higher."""
    return len(ids) / 10.0


class FakeRewardServer:
    """A reward server: ``mode`` ok | dead | hang | nan | wrong_count (settable mid-run)."""

    def __init__(self, url: str, score_fn: Callable[[list[int]], float] = length_score):
        self.url = url
        self.score_fn = score_fn
        self.mode = "ok"
        self.scored: Counter[tuple[int, ...]] = Counter()  # items answered with a score
        self.requests = 0
        self.release = asyncio.Event()
        self.fail_after: int | None = None  # requests answered before turning dead

    async def classify(self, batch: list[list[int]]) -> list[float]:
        self.requests += 1
        if self.fail_after is not None and self.requests > self.fail_after:
            self.mode = "dead"
        if self.mode == "dead":
            raise ConnectionRefusedError(f"{self.url}: connection refused")
        if self.mode == "hang":
            await self.release.wait()
        await asyncio.sleep(0)
        if self.mode == "wrong_count":
            return [self.score_fn(ids) for ids in batch[:-1]]
        if self.mode == "nan":
            return [math.nan for _ in batch]
        for ids in batch:
            self.scored[tuple(ids)] += 1
        return [self.score_fn(ids) for ids in batch]


class _Fleet:
    """Reward servers by URL, the clients built for them, and what the servers scored."""

    servers: dict[str, Any]
    clients: list[Any]

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    def _client(self, servers: Mapping[str, str], **kwargs: Any) -> Any:
        raise NotImplementedError

    def client_factory(self, servers: Mapping[str, str], **kwargs: Any) -> Any:
        client = self._client(servers, **kwargs)
        self.clients.append(client)
        return client

    def scored_items(self) -> Counter[tuple[int, ...]]:
        total: Counter[tuple[int, ...]] = Counter()
        for server in self.servers.values():
            total.update(server.scored)
        return total


class FakeRewardFleet(_Fleet):
    """In-process servers by URL; ``client_factory`` builds fake clients that reach them."""

    def __init__(self, count: int = 1, score_fn: Callable[[list[int]], float] = length_score):
        self.servers: dict[str, FakeRewardServer] = {}
        for i in range(count):
            self.add(f"http://127.0.0.1:{30100 + i}", score_fn)
        self.clients: list[FakeRewardModelClient] = []

    def add(self, url: str, score_fn: Callable[[list[int]], float] = length_score) -> None:
        self.servers[url] = FakeRewardServer(url, score_fn)

    def _client(self, servers: Mapping[str, str], **kwargs: Any) -> FakeRewardModelClient:
        return FakeRewardModelClient(servers, fleet=self, **kwargs)


class FakeRewardModelClient:
    """The client interface over a ``FakeRewardFleet`` (see the module docstring)."""

    def __init__(
        self,
        servers: Mapping[str, str],
        *,
        api_key: str | None,
        batch_size: int,
        request_timeout_s: float,
        max_attempts: int,
        retry_backoff_s: float,
        fleet: FakeRewardFleet,
    ):
        self.servers = dict(servers)
        self.api_key = api_key
        self.batch_size = batch_size
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.fleet = fleet
        self.counts: Counter[str] = Counter()
        self.closed = False
        self._next = 0

    def set_servers(self, servers: Mapping[str, str]) -> None:
        self.servers = dict(servers)

    async def score(self, input_ids: list[list[int]]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(input_ids), self.batch_size):
            out.extend(await self._batch(input_ids[start : start + self.batch_size]))
        return out

    async def _batch(self, batch: list[list[int]]) -> list[float]:
        names = sorted(self.servers)
        if not names:
            raise RewardServerError("no reward servers")
        tried = []
        first, self._next = self._next, self._next + 1  # round robin: batches start apart
        for attempt in range(self.max_attempts):
            name = names[(first + attempt) % len(names)]
            server = self.fleet.servers[self.servers[name]]
            tried.append(name)
            self.counts["requests"] += 1
            self.counts["failovers"] += attempt > 0
            try:
                scores = await asyncio.wait_for(server.classify(batch), self.request_timeout_s)
            except TimeoutError:
                self.counts["timeouts"] += 1
                continue
            except OSError:
                self.counts["errors"] += 1
                continue
            if len(scores) != len(batch):
                self.counts["bad_replies"] += 1
                continue
            self.counts["items"] += len(batch)
            return scores
        self.counts["failures"] += 1
        raise RewardServerError(f"batch of {len(batch)} not scored by {', '.join(tried)}")

    def stats(self) -> dict[str, float]:
        return {f"reward_model/{k}": float(v) for k, v in self.counts.items()}

    async def aclose(self) -> None:
        self.closed = True


class ScriptedClient:
    """A client that answers each ``score`` call with the next scripted reply (a list of
    floats, or an exception to raise): for the scorer's own checks of what a client returns."""

    def __init__(self, replies: list[Any]):
        self.replies = list(replies)
        self.calls: list[list[list[int]]] = []
        self.servers: dict[str, str] = {}

    def set_servers(self, servers: Mapping[str, str]) -> None:
        self.servers = dict(servers)

    async def score(self, input_ids: list[list[int]]) -> list[float]:
        self.calls.append(input_ids)
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def stats(self) -> dict[str, float]:
        return {"reward_model/requests": float(len(self.calls))}

    async def aclose(self) -> None:
        pass


class HttpRewardServer:
    """A hostile reward server on loopback answering POST /classify in SGLang's reply shape
    (a list of ``{"embedding": [score], "meta_info": {...}}``), ``mode`` as FakeRewardServer's;
    a batch with a NaN score is answered 500, as SGLang 0.5.23 answers it."""

    def __init__(self, url: str = "", score_fn: Callable[[list[int]], float] = length_score):
        self.url = url
        self.score_fn = score_fn
        self.mode = "ok"
        self.scored: Counter[tuple[int, ...]] = Counter()
        self.requests = 0
        self.fail_after: int | None = None
        self.release: asyncio.Event | None = None  # ends a hang (made on the servers' loop)

    async def classify(self, request: Any) -> Any:
        from aiohttp import web

        self.requests += 1
        if self.fail_after is not None and self.requests > self.fail_after:
            self.mode = "dead"
        if self.mode == "dead":  # the process is gone: the connection drops, no reply
            request.transport.close()
            raise web.HTTPServiceUnavailable()
        body = json.loads(await request.read())
        batch = body["input_ids"]
        if self.mode == "hang":  # until the fleet closes: then no reply at all
            self.release = self.release or asyncio.Event()
            await self.release.wait()
            raise web.HTTPServiceUnavailable()
        scores = [self.score_fn(ids) for ids in batch]
        if self.mode == "nan":
            scores = [math.nan] * len(batch)
        elif self.mode == "wrong_count":
            scores = scores[:-1]
        if not all(math.isfinite(s) for s in scores):  # SGLang's JSON cannot write the reply
            raise web.HTTPInternalServerError(text="Internal Server Error")
        if self.mode != "wrong_count":
            for ids in batch:
                self.scored[tuple(ids)] += 1
        items = [
            {"embedding": [s], "meta_info": {"id": rid, "finish_reason": {"type": "length"}}}
            for s, rid in zip(scores, body.get("rid") or [None] * len(scores), strict=False)
        ]
        return web.Response(text=json.dumps(items), content_type="application/json")


class HttpRewardFleet(_Fleet):
    """``count`` HttpRewardServers on loopback (their own thread and loop) and the REAL
    client (rollout_fleet/rewards/model_client.py) for them; ``close()`` ends them."""

    def __init__(self, count: int = 1, score_fn: Callable[[list[int]], float] = length_score):
        from rollout_fleet.rewards.model_client import RewardModelClient

        self._client_cls = RewardModelClient
        self.servers: dict[str, HttpRewardServer] = {}
        self.clients: list[Any] = []
        self._loop = asyncio.new_event_loop()
        self._runners: list[Any] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        for _ in range(count):
            server = HttpRewardServer(score_fn=score_fn)
            server.url = asyncio.run_coroutine_threadsafe(self._serve(server), self._loop).result()
            self.servers[server.url] = server

    async def _serve(self, server: HttpRewardServer) -> str:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/classify", server.classify)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    def _client(self, servers: Mapping[str, str], **kwargs: Any) -> Any:
        return self._client_cls(servers, **kwargs)

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers.values():
                if server.release is not None:
                    server.release.set()
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
