"""The agent gateway's HTTP server: OpenAI's routes over aiohttp, each call under its episode's key.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(each needs ``Authorization: Bearer <episode key>``, else 401 in OpenAI's shape),
and ``GET /health`` for the run's own probe (it needs the gateway's admin key,
made per start and never logged: nothing here answers without a key, loopback
included).

``AgentGateway`` runs on the event loop of the process that owns the fleet's
``SampleRunner`` (the rollout worker's), so a call costs one local HTTP hop
before it joins the same routing, failover and abort-resubmit path as every
sample. ``start(host, port)`` binds (a non-loopback host is served the same way:
every route needs a key) and returns the ``base_url`` agents are given;
``restart()`` (the watchdog's remedy for a gateway that stopped answering)
fails every live episode, counted, and binds again on the same port.

``stream: true`` sends events as the tokens are generated (``streaming``). The
stream's headers go out with its first event, so a call refused before anything
was generated (a bad body, a conversation too long) is an ordinary error reply; a
call that fails later ends its stream with an ``error`` event in OpenAI's shape,
which the ``openai`` client raises as ``APIError``.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet.gateway.calls import CallRunner, Choice
from rollout_fleet.gateway.episodes import SessionTable
from rollout_fleet.gateway.errors import ApiError, unauthorized
from rollout_fleet.gateway.replies import (
    DONE,
    chat_reply,
    completion_reply,
    models_reply,
    reply_id,
    sse,
)
from rollout_fleet.gateway.requests import ChatRequest, CompletionRequest, decode_body
from rollout_fleet.gateway.streaming import ReplyStream

log = get_logger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
RESTART_REASON = "the agent gateway restarted under the episode"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json")  # fmt: skip


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else None


class AgentGateway:
    """OpenAI-compatible front of the fleet for agent episodes (see the module docstring)."""

    def __init__(
        self,
        sessions: SessionTable,
        calls: CallRunner,
        *,
        model_name: str,
        token_text: Callable[[int], str],
    ) -> None:
        self.sessions = sessions
        self.calls = calls
        self.model_name = model_name
        self.token_text = token_text
        self.admin_key = secrets.token_urlsafe(32)
        self.host = "127.0.0.1"
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.restarts = 0
        self.episodes_failed_by_restart = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def serving(self) -> bool:
        return self._runner is not None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self.host, self.port = host, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._runner = runner
        log.info("agent gateway serving on %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self) -> int:
        """Bind again on the same address; every live episode fails (counted). How many did."""
        await self.stop()
        failed = self.sessions.fail_all(RESTART_REASON)
        self.episodes_failed_by_restart += failed
        await self.start(self.host, self.port)  # OSError if the port is not free yet
        self.restarts += 1
        log.warning(
            "agent gateway restarted on %s: %d episodes in flight failed", self.base_url, failed
        )
        return failed

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether ``GET /health`` answers 200 over the network, as an agent would reach it."""
        if self._runner is None:
            return False
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        url = f"http://{self.host}:{self.port}/health"
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, headers=headers) as resp,
            ):
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    # ---- handlers ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return _json(err.body(), err.status)
        except web.HTTPException as err:
            error = ApiError(err.status, err.reason or "not found", code=str(err.status))
            return _json(error.body(), err.status)

    async def _health(self, request: web.Request) -> web.Response:
        key = _bearer(request) or ""
        if not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise unauthorized("the health route needs the gateway's own key")
        return _json({"status": "ok", "episodes": len(self.sessions)})

    async def _models(self, request: web.Request) -> web.Response:
        self.sessions.episode(_bearer(request))
        return _json(models_reply(self.model_name))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self.sessions.episode(_bearer(request))
        req = decode_body(await request.read(), ChatRequest)
        logprobs = self.token_text if req.logprobs else None
        model = req.model or self.model_name
        if req.stream:
            stream = self._reply_stream(req, True, reply_id("chatcmpl"), model, logprobs)
            return await self._stream(request, stream, lambda watch: self.calls.chat(episode, req, watch))  # fmt: skip
        t0 = time.monotonic()
        choices = await self.calls.chat(episode, req)
        self.calls.call_s += time.monotonic() - t0
        return _json(chat_reply(reply_id("chatcmpl"), model, choices, logprobs))

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        episode = self.sessions.episode(_bearer(request))
        req = decode_body(await request.read(), CompletionRequest)
        logprobs = self.token_text if req.logprobs is not None else None
        model = req.model or self.model_name
        if req.stream:
            stream = self._reply_stream(req, False, reply_id("cmpl"), model, logprobs)
            return await self._stream(request, stream, lambda watch: self.calls.completion(episode, req, watch))  # fmt: skip
        t0 = time.monotonic()
        choices = await self.calls.completion(episode, req)
        self.calls.call_s += time.monotonic() - t0
        return _json(completion_reply(reply_id("cmpl"), model, choices, logprobs))

    def _reply_stream(self, req: Any, chat: bool, rid: str, model: str,
                      logprobs: Callable[[int], str] | None) -> ReplyStream:  # fmt: skip
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return ReplyStream(chat=chat, rid=rid, model=model, n=max(req.n, 1),
                           text_of=self.calls.renderer.generated_text,
                           sendable=self.calls.sendable(req), stops=stops, token_text=logprobs,
                           include_usage=bool((req.stream_options or {}).get("include_usage")))  # fmt: skip

    async def _stream(
        self,
        request: web.Request,
        stream: ReplyStream,
        run: Callable[[Callable[[int, list[int]], None]], Awaitable[list[Choice]]],
    ) -> web.StreamResponse:
        """Run the call, sending its events as its tokens come (see the module docstring)."""
        latest: dict[int, list[int]] = {}  # per choice, the ids so far not yet looked at
        arrived = asyncio.Event()

        def watch(index: int, ids: list[int]) -> None:
            latest[index] = ids
            arrived.set()

        t0 = time.monotonic()
        call = asyncio.ensure_future(run(watch))
        response: web.StreamResponse | None = None
        try:
            while True:
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({call, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if call.done() and call.exception() is not None and response is None:
                    raise call.exception()  # refused before anything was sent: a plain error
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})  # fmt: skip
                    await response.prepare(request)
                    await self._send(response, stream.opening())
                arrived.clear()
                pending = sorted(latest.items())
                latest.clear()
                for index, ids in pending:
                    await self._send(response, stream.tokens(index, ids))
                if call.done():
                    break
            error = call.exception()
            if error is None:
                await self._send(response, stream.closing(call.result()))
                self.calls.call_s += time.monotonic() - t0
            else:
                body = error.body() if isinstance(error, ApiError) else ApiError(
                    500, f"the call failed: {error}", type="server_error").body()  # fmt: skip
                log.warning("streamed call failed after its first event: %s", error)
                await response.write(sse(body))
            await response.write(DONE)
            await response.write_eof()
        finally:
            if not call.done():  # the client went away: stop generating for it
                call.cancel()
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, events: list[dict]) -> None:
        for event in events:
            await response.write(sse(event))

    def stats(self) -> dict[str, float]:
        out = self.calls.stats()
        out["agent/gateway_restarts"] = float(self.restarts)
        out["agent/episodes_failed_gateway_restart"] = float(self.episodes_failed_by_restart)
        return out
