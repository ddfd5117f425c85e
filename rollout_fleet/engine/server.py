"""The embedded engine's HTTP server: SGLang's native API over aiohttp.

``EmbeddedEngine`` = a ``ModelRunner`` + its ``Scheduler`` thread + an aiohttp
app. The event loop only parses, validates, renders and waits; all model work
happens on the scheduler thread, weight receives on one dedicated worker thread.

Endpoints (SGLang names; request/response fields in ``rollout_fleet.protocol``):
``POST /generate`` (non-streaming, or SSE ``data: {...}`` chunks then
``data: [DONE]``), ``POST /pause_generation``, ``POST /continue_generation``,
``POST /abort_request``, ``GET|POST /flush_cache`` (400 while requests are
pending), ``POST /update_weight_version``, ``GET /health``,
``GET /health_generate``, ``GET /model_info`` (with ``weight_version``),
``GET /server_info`` (and its deprecated name ``/get_server_info``; with SGLang's
``memory_usage``); the weight-update routes (``/init_weights_update_group``,
``/begin_weight_update``, ``/end_weight_update``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/get_weights_by_name``,
``/update_weights_from_disk``), handled by
``weight_routes.WeightRoutes``; for co-located engines ``/release_memory_occupation``,
``/resume_memory_occupation`` and ``/update_weights_from_tensor``, handled by
``colocated_routes.ColocatedRoutes`` (``memory_saver=True`` is SGLang's
``--enable-memory-saver``: released memory is freed); and for LoRA ``/load_lora_adapter`` and
``/unload_lora_adapter``, handled by ``adapter_routes.AdapterRoutes`` (which says
how this engine's one merged adapter differs from SGLang's per-request adapters).
``EmbeddedEngine.add_routes`` lists every route in one table. No route exists here that
a real SGLang server lacks: every CPU test of the training loop makes the calls a
GPU run makes.

Security and serving (``http_service.HttpService``, shared with the reward-model
engine): binds 127.0.0.1 by default; ``fleetrl engine`` requires an API key on any host
(``FLEETRL_API_KEY`` or ``--api-key``), the library on a non-loopback host (a run hands
its engines the run's key); with a key, every request except
``/health*`` (as in SGLang) must carry ``Authorization: Bearer <key>`` or gets 401.
Bodies are size-limited and decoded into typed Structs: a bad field is a 400
naming it, never a crash.

Run: ``fleetrl engine --model DIR --port 30000`` or
``python -m rollout_fleet.engine.cli --model DIR --port 30000``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Unpack

import msgspec
from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet import protocol as P
from rollout_fleet.engine.adapter_routes import AdapterRoutes
from rollout_fleet.engine.colocated_routes import ColocatedRoutes
from rollout_fleet.engine.http_json import json_response, read_body
from rollout_fleet.engine.http_service import HttpService, ServiceOptions
from rollout_fleet.engine.profile_routes import ProfileRoutes
from rollout_fleet.engine.relay import EventRelay
from rollout_fleet.engine.requests import (
    ModelLimits,
    RequestError,
    ResponseOptions,
    expand_generate,
    response_object,
)
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.scheduler import ANY_ADAPTER, Scheduler, Sequence
from rollout_fleet.engine.weight_routes import WeightRoutes

log = get_logger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


class EmbeddedEngine(HttpService):
    """An SGLang-compatible generation server over a Hugging Face causal LM."""

    def __init__(
        self,
        model_path: str,
        *,
        max_running_requests: int = 64,
        weight_version: str = P.INITIAL_WEIGHT_VERSION,
        receiver_factory: Any = None,
        memory_saver: bool = False,
        **service: Unpack[ServiceOptions],
    ) -> None:
        super().__init__(model_path, **service)
        self.runner = ModelRunner(model_path, device=self.device, dtype=self.dtype)
        self.scheduler = Scheduler(
            self.runner,
            max_running_requests=max_running_requests,
            weight_version=weight_version,
            name=self.engine_id,
        )
        self.limits = ModelLimits(
            vocab_size=self.runner.vocab_size,
            max_context=self.runner.max_context,
            eos_token_ids=frozenset(self.runner.eos_token_ids),
            device=self.runner.device,
        )
        self.weight_routes = WeightRoutes(
            self.runner,
            self.scheduler,
            engine_id=self.engine_id,
            receiver_factory=receiver_factory,
            on_model_path=self._served_from,
        )
        self.adapter_routes = AdapterRoutes(
            self.scheduler, engine_id=self.engine_id, weight_call=self.weight_routes.call
        )
        self.profile_routes = ProfileRoutes(self.engine_id)
        self.colocated_routes = ColocatedRoutes(
            self.runner,
            self.scheduler,
            engine_id=self.engine_id,
            memory_saver=memory_saver,
            session_open=lambda: self.weight_routes.session_open,
            weight_call=self.weight_routes.call,
        )
        self._relays: list[EventRelay] = []
        self.scheduler.add_delivery_hook(self._wake_relays)
        self.scheduler.start()

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread still runs (the actor's ping reports it)."""
        return self.scheduler.alive

    @property
    def adapters(self) -> dict[str, str]:
        """LoRA: the adapter held (name -> path), at most one."""
        return self.adapter_routes.adapters

    # -- lifecycle -------------------------------------------------------------------------

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/model_info", self.get_model_info)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_get("/server_info", self.get_server_info)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        weights, lora, coloc = self.weight_routes, self.adapter_routes, self.colocated_routes
        r.add_post("/init_weights_update_group", weights.init_weights_update_group)
        r.add_post("/begin_weight_update", weights.begin_weight_update)
        r.add_post("/end_weight_update", weights.end_weight_update)
        r.add_post("/update_weights_from_distributed", weights.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", weights.destroy_weights_update_group)
        r.add_post("/update_weights_from_disk", weights.update_weights_from_disk)
        r.add_get("/get_weights_by_name", weights.get_weights_by_name)
        r.add_post("/get_weights_by_name", weights.get_weights_by_name)
        r.add_post("/update_weights_from_tensor", coloc.update_weights_from_tensor)
        for method in (r.add_get, r.add_post):  # SGLang's api_route takes both
            method("/release_memory_occupation", coloc.release_memory_occupation)
            method("/resume_memory_occupation", coloc.resume_memory_occupation)
        r.add_post("/load_lora_adapter", lora.load_lora_adapter)
        r.add_post("/unload_lora_adapter", lora.unload_lora_adapter)
        r.add_post("/start_profile", self.profile_routes.start_profile)
        r.add_post("/stop_profile", self.profile_routes.stop_profile)

    def _served_from(self, model_path: str) -> None:
        """After ``/update_weights_from_disk``: /model_info names the folder, as SGLang's does."""
        self.model_path = model_path

    def stop(self) -> None:
        """Stop serving and the scheduler thread (in-flight requests finish as abort)."""
        self.stop_http()
        self.scheduler.stop()
        self.weight_routes.close()

    # -- generation ------------------------------------------------------------------------

    def _relay(self, loop: asyncio.AbstractEventLoop) -> EventRelay:
        """The relay for ``loop`` (normally one: the serving loop)."""
        for relay in self._relays:
            if relay.loop is loop:
                return relay
        relay = EventRelay(loop)
        self._relays = [*(r for r in self._relays if not r.loop.is_closed()), relay]
        return relay

    def _wake_relays(self) -> None:
        for relay in self._relays:
            relay.wake()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, P.GenerateRequest)
        relay = self._relay(asyncio.get_running_loop())
        events: asyncio.Queue = asyncio.Queue()

        def on_event(seq: Sequence, done: bool) -> None:
            # Called on the scheduler thread: snapshot what the loop needs.
            snapshot = (
                seq,
                done,
                len(seq.output_ids),
                seq.finish_reason,
                self.scheduler.weight_version,
            )
            relay.put(events, snapshot)

        adapter = self.adapter_routes.requested_adapter(req.lora_path)
        items, batched = expand_generate(req, self.runner.tokenizer, self.limits, on_event)
        for seq, _ in items:
            seq.adapter = adapter
        options = {id(seq): opt for seq, opt in items}
        await asyncio.wrap_future(self.scheduler.submit([seq for seq, _ in items]))
        try:
            if req.stream:
                return await self._stream(request, items, options, events)
            finals: dict[int, dict[str, Any]] = {}
            while len(finals) < len(items):
                seq, done, n, finish, version = await events.get()
                if done:
                    finals[options[id(seq)].index] = self._render(
                        seq, options[id(seq)], n, finish, version
                    )
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: free the batch rows its samples hold.
            for rid in {seq.parent_rid for seq, _ in items}:
                self.scheduler.abort(rid=rid, message="client disconnected")
            raise
        ordered = [finals[i] for i in range(len(items))]
        return json_response(ordered if batched or len(items) > 1 else ordered[0])

    def _render(
        self, seq: Sequence, opt: ResponseOptions, n: int, finish: Any, version: str
    ) -> dict:
        return response_object(
            seq,
            opt,
            self.runner.tokenizer,
            n_tokens=n,
            finish_reason=finish,
            weight_version=version,
        )

    async def _stream(self, request, items, options, events: asyncio.Queue) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        indexed = len(items) > 1
        remaining = len(items)
        while remaining:
            seq, done, n, finish, version = await events.get()
            opt = options[id(seq)]
            obj = self._render(seq, opt, n, finish if done else None, version)
            if indexed:
                obj["index"] = opt.index
            await resp.write(b"data: " + msgspec.json.encode(obj) + b"\n\n")
            remaining -= int(done)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- control ---------------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.PauseGenerationRequest, optional=True)
        count = await asyncio.wrap_future(self.scheduler.pause(req.mode))
        log.debug("%s paused (%s): %d sequences affected", self.engine_id, req.mode, count)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.wrap_future(self.scheduler.resume())
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.AbortRequest)
        if not req.rid and not req.abort_all:
            raise RequestError("give rid or abort_all=true")
        await asyncio.wrap_future(
            self.scheduler.abort(req.rid, req.abort_all, "aborted by abort_request")
        )
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await asyncio.wrap_future(self.scheduler.flush_cache())
        if ok:
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(
            text="Cache not flushed: there are running or waiting requests.\n", status=400
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.UpdateWeightVersionRequest)
        if req.abort_all_requests:
            await asyncio.wrap_future(self.scheduler.abort(abort_all=True))
        await asyncio.wrap_future(self.scheduler.set_weight_version(req.new_version))
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        sched = self.scheduler
        if not sched.alive:
            return web.Response(status=503)
        if sched.paused_mode is not None or sched.running or sched.memory_released:
            return web.Response(status=200)  # busy, paused or released: a probe would only queue
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        body = P.GenerateRequest(
            input_ids=[0],
            rid=f"HEALTH_CHECK_{time.time()}",
            sampling_params=P.SamplingParams(max_new_tokens=1, temperature=0.0),
        )

        def on_event(seq: Sequence, finished: bool) -> None:
            if finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(seq.finish_reason))

        ((seq, _),), _ = expand_generate(body, self.runner.tokenizer, self.limits, on_event)
        seq.adapter = ANY_ADAPTER  # a probe: whatever weights are held may answer it
        await asyncio.wrap_future(sched.submit([seq]))
        try:
            await asyncio.wait_for(done, HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            sched.abort(rid=seq.rid)
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        return self.model_info(is_generation=True, weight_version=self.scheduler.weight_version)

    async def get_server_info(self, request: web.Request) -> web.Response:
        return self.server_info(
            "fleetrl-embedded",
            max_running_requests=self.scheduler.max_running_requests,
            context_length=self.runner.max_context,
            weight_version=self.scheduler.weight_version,
            internal_states=[
                {**self.scheduler.load(), "memory_usage": self.colocated_routes.memory.usage()}
            ],
        )
