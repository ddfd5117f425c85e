"""The embedded engine's routes for co-location: memory release and resume, weights by handle.

SGLang 0.5.23's endpoints, with its semantics (``memory_saver`` has the details):

- ``GET|POST /release_memory_occupation`` ``{tags}``: free the memory of ``tags``
  (``weights``, ``kv_cache``, ``cuda_graph``; null or [] = all); refused unless the
  engine is idle (waiting requests do not count while paused); 200 with a null body.
- ``GET|POST /resume_memory_occupation`` ``{tags}``: take it back, cuda_graph ->
  weights -> kv_cache; a tag that was not released is refused. Resumed weights hold
  garbage until the next push fills them.
- ``POST /update_weights_from_tensor``: refused outside ``/begin_weight_update`` ...
  ``/end_weight_update`` (the session ``WeightRoutes`` keeps); decodes this engine's
  payload (entry 0: TP 1) with ``weight_sync.ipc_payload.decode_payload``, loads it
  between two scheduler steps (tokens decoded after it carry ``weight_version``),
  then flushes the prefix cache when ``flush_cache`` (SGLang's default; failing, as
  SGLang's does, while requests run). Answers ``{success, message}``.

Where SGLang would act on released memory this engine refuses instead (a weight
update while the weights are released is a 400, not a write to freed memory), and
unknown tags are a 400 naming the accepted ones (SGLang accepts and ignores them).

Security: the payload is a pickle whose tensors are handles to memory on this host,
meaningless anywhere else. The route answers 403 unless the caller is on this host
(a loopback peer, or a peer whose address is the one this server is bound to), the
API key is checked first by the server's middleware, and the payload is decoded by
``RestrictedUnpickler`` (torch's rebuild functions and SGLang's bucket metadata only).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from typing import Any

from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet import protocol as P
from rollout_fleet.engine.http_json import error_response, json_response, read_body
from rollout_fleet.engine.memory_saver import EngineMemory, MemoryOccupationError
from rollout_fleet.engine.runner import ModelRunner, WeightLoadError
from rollout_fleet.engine.scheduler import Scheduler
from weight_sync.ipc_payload import PayloadError, decode_payload

log = get_logger(__name__)

TP_RANK = 0  # the embedded engine is one rank: its entry of serialized_named_tensors
OUTSIDE_SESSION = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)  # SGLang's message


def same_host(request: web.Request) -> bool:
    """Whether the peer is this host: loopback, or the address this server is bound to."""
    peer = request.remote or ""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    local = sockname[0] if sockname else ""
    try:
        if ipaddress.ip_address(peer).is_loopback:
            return True
    except ValueError:
        return False
    return peer == local


class ColocatedRoutes:
    """Handlers for memory occupation and ``/update_weights_from_tensor`` over one engine."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        engine_id: str,
        memory_saver: bool,
        session_open: Callable[[], bool],
        weight_call: Callable[..., Any],
    ) -> None:
        self.scheduler = scheduler
        self.engine_id = engine_id
        self.memory = EngineMemory(runner, scheduler, enabled=memory_saver)
        self._session_open = session_open
        self._weight_call = weight_call  # runs a function on the engine's weight thread

    async def _on_scheduler(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._occupation(request, self.memory.release)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._occupation(request, self.memory.resume)

    async def _occupation(self, request: web.Request, change: Callable[..., Any]) -> web.Response:
        """Release or resume the body's tags on the scheduler thread; null, or 400 with why."""
        req = await read_body(request, P.MemoryOccupationRequest, optional=True)
        try:
            await self._on_scheduler(lambda: change(req.tags))
        except MemoryOccupationError as err:
            return error_response(str(err))
        return json_response(None)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        if not same_host(request):
            return error_response(
                "update_weights_from_tensor carries memory handles: only a caller on this "
                "host is accepted",
                403,
            )
        req = await read_body(request, P.UpdateWeightsFromTensorRequest)
        if not self._session_open():
            return json_response({"success": False, "message": OUTSIDE_SESSION}, 400)
        if not req.serialized_named_tensors:
            return json_response(
                {"success": False, "message": "serialized_named_tensors is empty"}, 400
            )
        if req.abort_all_requests:
            await asyncio.wrap_future(self.scheduler.abort(abort_all=True))
        entry = req.serialized_named_tensors[min(TP_RANK, len(req.serialized_named_tensors) - 1)]
        try:
            tensors = await self._weight_call(decode_payload, entry, req.load_format)
            # loaded (copied) before the reply: the producer may reuse its buffer after it
            count = await asyncio.wrap_future(
                self.scheduler.load_weights(tensors, req.weight_version)
            )
        except (PayloadError, WeightLoadError, RuntimeError) as err:
            log.error("%s: update_weights_from_tensor failed: %s", self.engine_id, err)
            return json_response({"success": False, "message": f"Failed to update: {err}"}, 400)
        finally:
            tensors = None  # drop the views: the producer's memory is unmapped here
        if req.flush_cache and not await asyncio.wrap_future(self.scheduler.flush_cache()):
            return json_response({"success": False, "message": NOT_FLUSHED}, 400)
        message = "Success"
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        log.debug("%s: %d tensors by handle, version %s", self.engine_id, count, req.weight_version)
        return json_response({"success": True, "message": message})
