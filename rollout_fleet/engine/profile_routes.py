"""The embedded engine's profiling routes: SGLang's ``/start_profile`` and ``/stop_profile``.

``trainer.profile_steps`` asks every engine, over these routes, to record the same span as
the learner ranks: ``/start_profile`` (body: ``protocol.ProfileRequest``, optional) starts
one torch.profiler span over the whole engine process (the scheduler's forward passes
included), ``/stop_profile`` ends it and writes the Chrome trace (``fleetrl.profiling``).
A real SGLang server answers the same two calls with its own traces. The replies are
SGLang's: 200 with a line of text; a second start, or a stop without a start, is 400.
"""

from __future__ import annotations

import os
from pathlib import Path

from aiohttp import web

from fleetrl.log import get_logger
from fleetrl.profiling import TraceSpan
from rollout_fleet import protocol as P
from rollout_fleet.engine.http_json import error_response, read_body

log = get_logger(__name__)

DEFAULT_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"  # SGLang's own default folder for traces


class ProfileRoutes:
    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.span = TraceSpan()
        self._target: Path | None = None

    async def start_profile(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.ProfileRequest, optional=True)
        if self.span.active:
            return error_response("a profile is already being recorded")
        folder = req.output_dir or os.environ.get(DEFAULT_DIR_ENV) or "/tmp"
        self._target = Path(folder) / f"{req.profile_prefix or ''}{self.engine_id}.json"
        cuda = None if req.activities is None else "GPU" in req.activities
        self.span.start(cuda=cuda)
        log.info("%s: profiling until /stop_profile (trace: %s)", self.engine_id, self._target)
        return web.Response(text="Start profiling.\n")

    async def stop_profile(self, request: web.Request) -> web.Response:
        if not self.span.active or self._target is None:
            return error_response("no profile is being recorded: call /start_profile first")
        target, self._target = self._target, None
        path = self.span.stop(target)  # on the thread that started it (torch.profiler needs it)
        log.info("%s: trace written to %s", self.engine_id, path)
        return web.Response(text="Stop profiling. This will take some time.\n")
