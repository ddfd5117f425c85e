"""The embedded engine's LoRA routes: ``POST /load_lora_adapter``, ``POST /unload_lora_adapter``,
and which adapter a ``/generate`` names.

Bodies, replies (SGLang's ``LoRAUpdateOutput``) and error texts are SGLang's.
The semantics differ from SGLang's, by design: SGLang applies each request's
adapter per request, several in one batch; this engine holds one adapter, the
newest loaded, merged into its weights (``ModelRunner.apply_adapter``; per-row
adapters would need a LoRA path through the fused decode step and the batched
prefill). Loading an adapter replaces the one held (it is unloaded, and the
requests that named it finish with ``abort`` and are resubmitted under the new
name, as after an abort pause); a ``/generate`` naming an adapter that is not
held gets SGLang's "not loaded" error, and a request without ``lora_path``
while an adapter is held is refused (this engine cannot serve the base model
beside it). So every token a request gets comes from the adapter it named, which
is what fleetrl's version tags assume (``rollout_fleet.adapters``).

``AdapterRoutes`` owns the adapter held (``adapters``: name -> folder, at most
one) and the lock that serialises loads and unloads; the folder is read on the
engine's weight thread (``WeightRoutes.call``) and swapped in by the scheduler.
``EmbeddedEngine`` composes one and lists its handlers in its route table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet import protocol as P
from rollout_fleet.engine.http_json import json_response, read_body
from rollout_fleet.engine.requests import RequestError
from rollout_fleet.engine.scheduler import Scheduler

log = get_logger(__name__)


class AdapterRoutes:
    """Handlers for SGLang's LoRA endpoints; holds the one adapter the engine serves."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        engine_id: str,
        weight_call: Callable[..., Awaitable[Any]],
    ) -> None:
        self.scheduler = scheduler
        self.engine_id = engine_id
        self._weight_call = weight_call  # runs a blocking call on the engine's weight thread
        self.adapters: dict[str, str] = {}  # the adapter held (name -> path), at most one
        self._lock: asyncio.Lock | None = None  # made on the serving loop, at first use

    def requested_adapter(self, lora_path: str | list[str | None] | None) -> str | None:
        """The one adapter a /generate names; RequestError (400) in SGLang's words if it is
        not held, or in ours for what this engine cannot serve beside its adapter."""
        names = set(lora_path) if isinstance(lora_path, list) else {lora_path}
        if len(names) > 1:
            raise RequestError(
                f"this engine serves one LoRA adapter at a time; the request names {sorted(map(str, names))}"
            )
        (name,) = names
        if name is None:
            if self.adapters:
                raise RequestError(
                    f"LoRA adapter {next(iter(self.adapters))} is merged into this engine's weights;"
                    " name it in lora_path (the base model is not served beside it)"
                )
            return None
        if name not in self.adapters:
            raise RequestError(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {list(self.adapters)}."
            )
        return name

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.LoadLoRAAdapterRequest)
        async with self._lora_lock():
            if req.lora_name in self.adapters:
                return self._lora_reply(
                    f"Failed to load LoRA adapter {req.lora_name} because it is already loaded"
                )
            from weight_sync.adapters import read_adapter_folder

            try:
                weights = await self._weight_call(read_adapter_folder, req.lora_path)
                await asyncio.wrap_future(self.scheduler.switch_adapter(req.lora_name, weights))
            except (ValueError, OSError) as err:
                log.error("%s: load_lora_adapter %s failed: %s", self.engine_id, req.lora_name, err)
                return self._lora_reply(str(err))
            self.adapters = {req.lora_name: req.lora_path}
        log.info("%s serves LoRA adapter %s", self.engine_id, req.lora_name)
        return self._lora_reply()

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.UnloadLoRAAdapterRequest)
        async with self._lora_lock():
            if req.lora_name not in self.adapters:
                return self._lora_reply(
                    f"LoRA with name {req.lora_name} does not exist. Loaded LoRAs: {list(self.adapters)}"
                )
            await asyncio.wrap_future(self.scheduler.remove_adapter(req.lora_name))
            del self.adapters[req.lora_name]
        return self._lora_reply()

    def _lora_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _lora_reply(self, error: str | None = None) -> web.Response:
        """SGLang's ``LoRAUpdateOutput``: 200 on success, 400 with ``error_message`` else."""
        body = {
            "success": error is None,
            "error_message": error or "",
            "loaded_adapters": dict(self.adapters) if error is None else None,
        }
        return json_response(body, 200 if error is None else 400)
