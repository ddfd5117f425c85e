"""The embedded engine's weight-update routes, and the state they share.

SGLang's endpoints for pushing new weights into a running server:
``POST /init_weights_update_group`` (join the trainer's NCCL/gloo group),
``POST /begin_weight_update`` / ``POST /end_weight_update`` (the update session:
as in SGLang 0.5.23, an update outside it is refused with 400),
``POST /update_weights_from_distributed`` (receive named tensors over the group
and load them), ``POST /destroy_weights_update_group``,
``GET|POST /get_weights_by_name`` (the leading rows of one tensor, to check a push)
and ``POST /update_weights_from_disk`` (a whole checkpoint folder, read by
``disk_weights.read_checkpoint``; as in SGLang it needs no update session).

``WeightRoutes`` owns what those calls share: the weight receiver (built on the
first ``/init_weights_update_group``; ``weight_sync.receiver.WeightReceiver``
unless the server was given a factory), whether an update session is open, and
the one worker thread every receive runs on (``call``): the event loop never
blocks on a collective, and the receive arena is reused only after the
scheduler has loaded the previous tensors. The LoRA routes read adapter folders
on the same thread. ``EmbeddedEngine`` composes one and lists its handlers in
its route table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet import protocol as P
from rollout_fleet.engine.http_json import json_response, read_body
from rollout_fleet.engine.requests import RequestError
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.scheduler import Scheduler

log = get_logger(__name__)


class WeightRoutes:
    """Handlers for SGLang's weight-update endpoints over one engine's scheduler."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        engine_id: str,
        receiver_factory: Callable[[], Any] | None = None,
        on_model_path: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.runner = runner
        self._on_model_path = on_model_path  # /model_info reports the folder last loaded
        self.scheduler = scheduler
        self.engine_id = engine_id
        self._receiver_factory = receiver_factory
        self._receiver: Any = None
        self._update_session = False  # between /begin_weight_update and /end_weight_update
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{engine_id}-weights")

    @property
    def session_open(self) -> bool:
        """Between ``/begin_weight_update`` and ``/end_weight_update``."""
        return self._update_session

    async def call(self, fn, *args) -> Any:
        """``fn(*args)`` on the weight thread, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Close the receiver (on the weight thread) and let the thread end."""
        if self._receiver is not None and hasattr(self._receiver, "close"):
            self._pool.submit(self._receiver.close)
        self._pool.shutdown(wait=False, cancel_futures=False)

    def _get_receiver(self) -> Any:
        if self._receiver is None:
            if self._receiver_factory is not None:
                self._receiver = self._receiver_factory()
            else:
                from weight_sync.receiver import WeightReceiver

                self._receiver = WeightReceiver(device=self.runner.device)
        return self._receiver

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.InitWeightsUpdateGroupRequest)
        try:
            receiver = await self.call(self._get_receiver)
            await self.call(
                lambda: receiver.init_group(
                    req.master_address,
                    req.master_port,
                    req.rank_offset,
                    req.world_size,
                    req.group_name,
                    req.backend,
                )
            )
        except (ImportError, RuntimeError, ValueError, OSError, TimeoutError) as err:
            log.error("%s: init_weights_update_group failed: %s", self.engine_id, err)
            return json_response(
                {"success": False, "message": f"init_weights_update_group failed: {err}"}, 400
            )
        return json_response(
            {
                "success": True,
                "message": f"joined group {req.group_name!r} at rank {req.rank_offset}",
            }
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.UpdateWeightsFromDistributedRequest)
        try:
            req.check()
        except ValueError as err:
            raise RequestError(str(err)) from err
        if not self._update_session:
            return json_response(
                {
                    "success": False,
                    "message": "update_weights_from_distributed must run between "
                    "begin_weight_update() and end_weight_update()",
                },
                400,
            )
        if self._receiver is None:
            return json_response(
                {
                    "success": False,
                    "message": "no weight update group: call /init_weights_update_group first",
                },
                400,
            )
        if req.abort_all_requests:
            await asyncio.wrap_future(self.scheduler.abort(abort_all=True))
        receiver = self._receiver
        try:
            # The weight thread waits for the scheduler's load: the receive arena is reused.
            count = await self.call(
                receiver.receive,
                req.names,
                req.dtypes,
                req.shapes,
                req.group_name,
                req.load_format,
                lambda tensors: self.scheduler.load_weights(tensors, req.weight_version).result(),
            )
        except (RuntimeError, ValueError, OSError, TimeoutError) as err:
            log.error("%s: update_weights_from_distributed failed: %s", self.engine_id, err)
            return json_response(
                {"success": False, "message": f"update_weights_from_distributed failed: {err}"}, 400
            )
        message = f"Succeeded to update {count} tensors."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return json_response({"success": True, "message": message})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.DestroyWeightsUpdateGroupRequest, optional=True)
        if self._receiver is None:
            return json_response(
                {"success": False, "message": f"no weight update group {req.group_name!r}"}, 400
            )
        try:
            await self.call(self._receiver.destroy, req.group_name)
        except (RuntimeError, ValueError, OSError) as err:
            return json_response(
                {"success": False, "message": f"destroy_weights_update_group failed: {err}"}, 400
            )
        return json_response({"success": True, "message": f"destroyed group {req.group_name!r}"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await read_body(request, P.WeightUpdateSessionRequest, optional=True)
        if self._update_session:
            return json_response(
                {
                    "success": False,
                    "message": "a weight-update session is already open; "
                    "call end_weight_update() first",
                },
                400,
            )
        self._update_session = True
        return json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_body(request, P.WeightUpdateSessionRequest, optional=True)
        if not self._update_session:
            return json_response(
                {
                    "success": False,
                    "message": "no weight-update session is open; call begin_weight_update() first",
                },
                400,
            )
        self._update_session = False
        return json_response({"success": True, "message": "Success"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load a checkpoint folder in place (SGLang's reply: success, message,
        num_paused_requests; 400 and unchanged weights when it fails).

        The load runs between two scheduler steps: requests in flight continue on the
        new weights, their later tokens tagged with ``weight_version`` (SGLang waits
        for them to finish instead; ``abort_all_requests`` stops them first).
        """
        from rollout_fleet.engine.disk_weights import read_checkpoint
        from rollout_fleet.engine.runner import WeightLoadError

        req = await read_body(request, P.UpdateWeightsFromDiskRequest)
        try:
            req.check()
        except ValueError as err:
            raise RequestError(str(err)) from err
        if req.abort_all_requests:
            await asyncio.wrap_future(self.scheduler.abort(abort_all=True))
        try:
            served = self.runner.named_weights()
            tensors = await self.call(read_checkpoint, req.model_path, served)
            count = await asyncio.wrap_future(
                self.scheduler.load_weights(tensors, req.weight_version)
            )
        except (WeightLoadError, OSError, RuntimeError) as err:
            log.error(
                "%s: update_weights_from_disk %s failed: %s", self.engine_id, req.model_path, err
            )
            return json_response(
                {
                    "success": False,
                    "message": f"Failed to update weights: {err}",
                    "num_paused_requests": 0,
                },
                400,
            )
        self._on_model_path(req.model_path)
        message = f"Succeeded to update model weights ({count} tensors)."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """The leading rows of one tensor as float lists (SGLang's reply shape), or 400."""
        req = await read_body(request, P.GetWeightsByNameRequest)
        rows = await asyncio.wrap_future(
            self.scheduler.call(lambda: self.runner.weight_rows(req.name, req.truncate_size))
        )
        if rows is None:
            return json_response({"error": {"message": "Get parameter by name failed"}}, 400)
        return json_response(rows)
