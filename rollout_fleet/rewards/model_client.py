"""The reward-model client: batched ``/classify`` over a pool of servers, with retries and failover.

``RewardModelClient.score(input_ids)`` cuts the token lists into batches of at most
``batch_size``, sends each batch as one SGLang ``/classify`` request
(``{"input_ids": [[...], ...], "rid": [...]}``; the reply is one ``{"embedding": [score],
"meta_info": ...}`` per input, ``embedding[0]`` being the one-label head's score) and
returns one float per input, in order. Servers are SGLang (``--is-embedding``) or the
embedded engine serving a reward folder; never ``/v1/classify``, whose softmax makes a
one-label model read 1.0.

Faults fail samples, not batches, where they come from one input. A score that is null or
not finite (the embedded reward engine writes NaN and inf as null) comes back as NaN and
the scorer fails that sample alone. SGLang 0.5.23 cannot write such a reply at all (its
JSON refuses NaN) and answers the whole batch with HTTP 500: a batch answered 500 is split
in halves, each scored on its own (its own attempts), until the input that fails is
alone; an input answered 500 and never scored comes back as NaN, the others are scored
(a server failing everything costs about two requests per input before its samples fail).

An attempt fails on: no answer (refused, reset, a server that died), a timeout
(``request_timeout_s``), HTTP 5xx / 408 / 429, or a bad reply (not JSON, the wrong number
of items, an item without a score, a score that is not a number). The batch is then
tried again after ``retry_backoff_s`` × 2^(k-1) on another
server (failover: servers the batch has not failed on first, then servers not cooling
after a failure of their own, ``retry_backoff_s`` × 2^failures up to the timeout, then the
least loaded) until ``max_attempts`` attempts are spent, and then ``RewardServerError`` names each server
tried and why; other 4xx answers (a refused input, a wrong key, a server that does not
serve ``/classify``) fail at once, since every server would answer the same. A batch is
answered by exactly one server: a reply is used only from the attempt that got it. No
score is ever made up (never a silent 0). Each attempt has its own rids
(``rm-<batch>-<index>-<attempt>``), so a late duplicate on a hung server never collides
with its retry (SGLang refuses a rid already in flight).

``set_servers`` replaces the pool (the reward fleet replaced or added a server); batches
in flight keep their attempt, later attempts use the new pool, and an attempt that finds
no server waits for one up to ``request_timeout_s``. ``stats()`` are cumulative
``reward_model/*`` counters. Not thread-safe: call it from one event loop (the rollout
role's). Left out: hedged requests; health probes of its own (the reward fleet's health
checks replace dead servers and call ``set_servers``).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from fleetrl.log import get_logger

if TYPE_CHECKING:
    from rollout_fleet.rewards.config import RewardModelConfig

log = get_logger(__name__)

CLASSIFY_PATH = "/classify"
RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx
# SGLang's answer to a batch whose reply it cannot write (a NaN or inf score: its JSON
# refuses them) is a 500, as for its other internal errors: the batch is split
INPUT_ERROR_STATUS = 500
COUNTERS = ("requests", "items", "retries", "failovers", "timeouts", "bad_replies", "failures",
            "splits", "inputs_refused")  # fmt: skip
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


class RewardServerError(RuntimeError):
    """A batch that could not be scored: which servers were tried, and what each did."""

    def __init__(self, message: str, *, servers: list[str], causes: list[str]) -> None:
        self.servers = servers
        self.causes = causes
        super().__init__(message)


class _AttemptFailed(Exception):
    """One attempt failed; ``retry`` says whether another server may do better; ``status``
    is the HTTP status of a server that answered (0: no answer)."""

    def __init__(self, cause: str, *, retry: bool, status: int = 0) -> None:
        self.cause = cause
        self.retry = retry
        self.status = status
        super().__init__(cause)


@dataclass
class _Server:
    name: str
    url: str
    in_flight: int = 0
    failures: int = 0  # consecutive failed attempts (reset by a success)
    cooling_until: float = 0.0  # after a failure: tried last until then


class RewardModelClient:
    """Scores token lists on reward-model servers; see the module docstring."""

    def __init__(
        self,
        servers: Mapping[str, str],
        *,
        api_key: str | None,
        batch_size: int,
        request_timeout_s: float,
        max_attempts: int,
        retry_backoff_s: float,
    ) -> None:
        if batch_size < 1 or max_attempts < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_attempts ({max_attempts}) must be >= 1")  # fmt: skip
        if request_timeout_s <= 0 or retry_backoff_s < 0:
            raise ValueError(
                f"request_timeout_s ({request_timeout_s}) must be > 0 and retry_backoff_s"
                f" ({retry_backoff_s}) >= 0"
            )
        self.api_key = api_key
        self.batch_size = batch_size
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self._servers: dict[str, _Server] = {}
        self._retired: dict[str, _Server] = {}  # left the pool with attempts still running
        self._pool_changed: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._turn = 0  # round-robin among equally loaded servers
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._answered = 0  # requests with a usable reply
        self._latency_sum = 0.0
        self._latency_max = 0.0
        self.set_servers(servers)

    @classmethod
    def from_config(
        cls, config: RewardModelConfig, servers: Mapping[str, str], api_key: str | None
    ) -> RewardModelClient:
        """A client with the ``reward.model`` section's batching, timeout and retry keys."""
        return cls(
            servers,
            api_key=api_key,
            batch_size=config.batch_size,
            request_timeout_s=config.request_timeout_s,
            max_attempts=config.max_attempts,
            retry_backoff_s=config.retry_backoff_s,
        )

    # -- the pool --------------------------------------------------------------------------

    def set_servers(self, servers: Mapping[str, str]) -> None:
        """Score on ``servers`` (name -> base URL) from the next attempt on."""
        kept = {}
        for name, url in servers.items():
            url = url.rstrip("/")
            old = self._servers.get(name)
            kept[name] = old if old is not None and old.url == url else _Server(name, url)
        if {n: s.url for n, s in kept.items()} != self.servers:
            log.info("reward servers: %s", {n: s.url for n, s in kept.items()} or "none")
        for name, old in self._servers.items():
            if kept.get(name) is not old and old.in_flight:
                self._retired[name] = old
        self._servers = kept
        if self._pool_changed is not None:
            self._pool_changed.set()

    @property
    def servers(self) -> dict[str, str]:
        return {name: s.url for name, s in self._servers.items()}

    def in_flight(self, name: str) -> int:
        """Attempts running on server ``name``, in the pool or taken out of it (a server
        that drains before it stops waits for these)."""
        retired = self._retired.get(name)
        if retired is not None and not retired.in_flight:
            del self._retired[name]
            retired = None
        server = self._servers.get(name)
        return (server.in_flight if server else 0) + (retired.in_flight if retired else 0)

    def _pick(self, avoid: set[str]) -> _Server | None:
        """Servers this batch has not failed on first, then those not cooling after a
        failure, then the least loaded (round-robin among equals)."""
        pool = list(self._servers.values())
        if not pool:
            return None
        self._turn += 1
        now = time.monotonic()
        order = {s.name: (i - self._turn) % len(pool) for i, s in enumerate(pool)}
        return min(
            pool,
            key=lambda s: (s.name in avoid, s.cooling_until > now, s.in_flight, order[s.name]),
        )

    def _failed(self, server: _Server) -> None:
        """Cool a server that failed: ``retry_backoff_s`` × 2^failures, at most the timeout."""
        server.failures += 1
        cooldown = min(self.request_timeout_s, self.retry_backoff_s * 2**server.failures)
        server.cooling_until = time.monotonic() + cooldown

    async def _wait_for_a_server(self) -> _Server | None:
        if self._pool_changed is None:
            self._pool_changed = asyncio.Event()
        self._pool_changed.clear()
        try:
            await asyncio.wait_for(self._pool_changed.wait(), self.request_timeout_s)
        except TimeoutError:
            return None
        return self._pick(set())

    # -- scoring ---------------------------------------------------------------------------

    async def score(self, input_ids: list[list[int]]) -> list[float]:
        """One score per token list, in order (``RewardServerError`` if a batch fails)."""
        if not input_ids:
            return []
        size = self.batch_size
        batches = [input_ids[i : i + size] for i in range(0, len(input_ids), size)]
        results = await asyncio.gather(
            *(self._score_batch(b) for b in batches), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [score for batch in results for score in batch]  # type: ignore[union-attr]

    async def _score_batch(self, batch: list[list[int]]) -> list[float]:
        batch_id = uuid.uuid4().hex[:12]
        tried: list[str] = []
        causes: list[str] = []
        for attempt in range(self.max_attempts):
            if attempt:
                self._counts["retries"] += 1
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            server = self._pick(set(tried)) or await self._wait_for_a_server()
            if server is None:
                causes.append(f"no reward server available for {self.request_timeout_s:g}s")
                continue
            if tried and server.name != tried[-1]:
                self._counts["failovers"] += 1
            tried.append(server.name)
            rids = [f"rm-{batch_id}-{i}-{attempt}" for i in range(len(batch))]
            try:
                scores = await self._attempt(server, batch, rids)
            except _AttemptFailed as err:
                self._failed(server)
                causes.append(f"{server.name} ({server.url}): {err.cause}")
                log.warning("reward model: attempt %d of a batch of %d on %s failed: %s", attempt + 1, len(batch), server.name, err.cause)  # fmt: skip
                if err.status == INPUT_ERROR_STATUS and len(batch) > 1:
                    return await self._split(batch)
                if not err.retry:
                    break
                continue
            server.failures, server.cooling_until = 0, 0.0
            self._counts["items"] += len(batch)
            return scores
        if len(batch) == 1 and any(f"HTTP {INPUT_ERROR_STATUS}:" in c for c in causes):
            self._counts["inputs_refused"] += 1
            log.warning("reward model: an input was refused by every attempt (%s): its sample fails", causes[-1])  # fmt: skip
            return [math.nan]
        self._counts["failures"] += 1
        names = list(dict.fromkeys(tried))
        raise RewardServerError(
            f"reward model: a batch of {len(batch)} inputs was not scored after {len(causes)}"
            f" attempt(s) on {names or 'no server'}: " + "; ".join(causes),
            servers=names,
            causes=causes,
        )

    async def _split(self, batch: list[list[int]]) -> list[float]:
        """Both halves of a batch a server could not answer, scored apart (module docstring)."""
        self._counts["splits"] += 1
        half = len(batch) // 2
        first, second = await asyncio.gather(
            self._score_batch(batch[:half]), self._score_batch(batch[half:])
        )
        return first + second

    async def _attempt(self, server: _Server, batch: list[list[int]], rids: list[str]) -> list[float]:  # fmt: skip
        session = self._get_session()
        body = _ENCODER.encode({"input_ids": batch, "rid": rids})
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        self._counts["requests"] += 1
        server.in_flight += 1
        started = time.perf_counter()
        try:
            async with session.post(
                server.url + CLASSIFY_PATH,
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=timeout,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            self._counts["timeouts"] += 1
            raise _AttemptFailed(f"no reply within {self.request_timeout_s:g}s", retry=True) from None  # fmt: skip
        except aiohttp.ClientError as err:
            raise _AttemptFailed(f"no reply: {type(err).__name__}: {err}", retry=True) from None
        finally:
            server.in_flight -= 1
        if status >= 400:
            text = raw.decode("utf-8", errors="replace").strip()[:300]
            retry = status >= 500 or status in RETRYABLE_STATUS
            raise _AttemptFailed(f"HTTP {status}: {text}", retry=retry, status=status)
        try:
            scores = parse_classify_reply(raw, len(batch))
        except ValueError as err:
            self._counts["bad_replies"] += 1
            raise _AttemptFailed(f"bad reply: {err}", retry=True) from None
        elapsed = time.perf_counter() - started
        self._answered += 1
        self._latency_sum += elapsed
        self._latency_max = max(self._latency_max, elapsed)
        return scores

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers)
        return self._session

    def stats(self) -> dict[str, float]:
        """Cumulative ``reward_model/*`` counters (latency: seconds per answered request)."""
        out = {f"reward_model/{k}": float(v) for k, v in self._counts.items()}
        answered = self._answered
        out["reward_model/latency_s"] = self._latency_sum / answered if answered else 0.0
        out["reward_model/latency_max_s"] = self._latency_max
        out["reward_model/servers"] = float(len(self._servers))
        return out

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def parse_classify_reply(raw: bytes, expected: int) -> list[float]:
    """``embedding[0]`` of each item of a batched ``/classify`` reply, NaN where the score is
    null or not finite (that sample fails, the others stand); ``ValueError`` if the reply is
    not JSON, not a list of ``expected`` items, or a score is missing or not a number."""
    try:
        data: Any = _DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:  # 1e999: out of range
        raise ValueError(f"not readable JSON ({err})") from None
    if not isinstance(data, list):
        raise ValueError(f"expected a list of {expected} items, got {type(data).__name__}")
    if len(data) != expected:
        raise ValueError(f"{len(data)} items for a batch of {expected}")
    scores = []
    for i, item in enumerate(data):
        embedding = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(embedding, list) or not embedding:
            raise ValueError(f"item {i} has no embedding")
        value = embedding[0]
        if value is None:  # SGLang's JSON for NaN and inf
            value = math.nan
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"item {i} has score {value!r}, not a number")
        scores.append(float(value) if math.isfinite(value) else math.nan)
    return scores
