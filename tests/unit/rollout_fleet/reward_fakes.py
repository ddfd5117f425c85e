"""In-process fakes of reward-model servers and of their client, for the reward pipeline's tests.

``FakeRewardModelClient`` has the interface of ``rollout_fleet.rewards.model_client
.RewardModelClient`` (the reward-serve branch's): ``score`` splits the inputs into
batches of ``batch_size``, sends each to a server, and on a dead, hung (timeout),
non-finite or wrong-count reply tries the next server, up to ``max_attempts``,
then raises ``RewardServerError`` naming the servers tried. The servers
(``FakeRewardServer``) are plain objects found by URL in a ``FakeRewardFleet``;
each logs every item it scored, so a test can count items lost or scored twice.
The fault tests that use them are to be rerun on the real client and servers.
"""

from __future__ import annotations

import asyncio
import math
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


class FakeRewardFleet:
    """Servers by URL; ``client_factory`` builds clients that reach them."""

    def __init__(self, count: int = 1, score_fn: Callable[[list[int]], float] = length_score):
        self.servers: dict[str, FakeRewardServer] = {}
        for i in range(count):
            self.add(f"http://127.0.0.1:{30100 + i}", score_fn)
        self.clients: list[FakeRewardModelClient] = []

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    def add(self, url: str, score_fn: Callable[[list[int]], float] = length_score) -> None:
        self.servers[url] = FakeRewardServer(url, score_fn)

    def client_factory(self, servers: Mapping[str, str], **kwargs: Any) -> FakeRewardModelClient:
        client = FakeRewardModelClient(servers, fleet=self, **kwargs)
        self.clients.append(client)
        return client

    def scored_items(self) -> Counter[tuple[int, ...]]:
        total: Counter[tuple[int, ...]] = Counter()
        for server in self.servers.values():
            total.update(server.scored)
        return total


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
            if len(scores) != len(batch) or not all(math.isfinite(s) for s in scores):
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
