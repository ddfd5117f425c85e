"""The embedded engine for a reward model: SGLang's embedding-server API over aiohttp.

``RewardEngine`` = a ``ScoreRunner`` (the ``*ForSequenceClassification`` model) + its
``ScoreWorker`` thread + an aiohttp app, served like the generation engine
(``http_service.HttpService``: loopback unless a key is set, bearer key, 400s naming the
field). It answers what SGLang 0.5.23 answers when it serves a reward model
(``--is-embedding``, or an architecture SGLang knows as one):

- ``POST|PUT /classify`` and ``/encode``: ``EmbeddingReqInput`` bodies
  (``protocol.EmbeddingRequest``), the head at each input's last token, in SGLang's reply
  shape (``embedding_requests``); the requests waiting are scored together, off the event
  loop, in sorted padded forwards (``score_worker``, ``score_runner``);
- ``GET /health``: 200 while the scoring thread lives (SGLang answers without running the
  model unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``); ``GET /health_generate``:
  scores a one-token probe (``input_ids=[0]``, as SGLang's embedding probe), 200 at once
  when requests are running, 503 when the probe does not finish in time;
- ``GET /model_info`` (``is_generation: false``, ``weight_version``, the architectures),
  ``GET /get_server_info``;
- ``POST /update_weights_from_disk``: a folder's safetensors loaded in place between two
  forwards (SGLang's reply; 400 and unchanged weights when it fails);
- ``POST|PUT /generate``: 400. SGLang 0.5.23 has no refusal of its own (its tokenizer
  manager passes the request to a scheduler that runs embedding models only); here the
  message says to score with ``/classify``.

Reward servers never take weight pushes: the update-group routes are absent. Left out:
LoRA adapters, Matryoshka dimensions, cross-encoder pairs, multimodal inputs.

Run: ``fleetrl engine --model RM_DIR`` (the folder's architecture picks this engine).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Unpack

from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet import protocol as P
from rollout_fleet.engine.embedding_requests import embedding_reply, expand_embedding
from rollout_fleet.engine.http_json import error_response, json_response, read_body
from rollout_fleet.engine.http_service import HttpService, ServiceOptions
from rollout_fleet.engine.requests import RequestError
from rollout_fleet.engine.score_runner import MAX_BATCH_TOKENS, ScoreRunner
from rollout_fleet.engine.score_worker import ScoreWorker

log = get_logger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
HEALTH_PROBE = [0]  # the one-token input SGLang's /health_generate sends an embedding model


class RewardEngine(HttpService):
    """An SGLang-compatible reward-model server; see the module docstring."""

    default_engine_id = "reward-0"

    def __init__(
        self,
        model_path: str,
        *,
        max_running_requests: int = 64,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        weight_version: str = P.INITIAL_WEIGHT_VERSION,
        log_requests: bool = False,
        **service: Unpack[ServiceOptions],
    ) -> None:
        super().__init__(model_path, **service)
        self.weight_version = weight_version
        self.log_requests = log_requests  # SGLang's --log-requests: one line per input
        self.runner = ScoreRunner(
            model_path,
            device=self.device,
            dtype=self.dtype,
            max_rows=max_running_requests,
            max_batch_tokens=max_batch_tokens,
        )
        self.worker = ScoreWorker(
            self.runner, max_running_requests=max_running_requests, name=self.engine_id
        )

    def add_routes(self, r: web.UrlDispatcher) -> None:
        for path in ("/classify", "/encode"):
            r.add_post(path, self.classify)
            r.add_put(path, self.classify)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/model_info", self.get_model_info)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def stop(self) -> None:
        """Stop serving and the scoring thread (requests waiting fail)."""
        self.stop_http()
        self.worker.stop()

    # -- scoring ---------------------------------------------------------------------------

    async def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """The head's values for each token list (scored on the worker thread)."""
        return await asyncio.wrap_future(self.worker.submit(prompts))

    async def classify(self, request: web.Request) -> web.Response:
        req = await read_body(request, P.EmbeddingRequest)
        items = expand_embedding(
            req,
            self.runner.tokenizer,
            vocab_size=self.runner.vocab_size,
            context_len=self.runner.max_context,
            model_path=self.model_path,
        )
        if self.log_requests:
            for rid, prompt in zip(items.rids, items.prompts, strict=True):
                log.info("%s %s rid=%s prompt_tokens=%d", self.engine_id, request.path, rid, len(prompt))  # fmt: skip
        scores = await self.score(items.prompts)
        version = self.weight_version
        replies = [
            embedding_reply(rid, values, len(prompt), version, items.received_at)
            for rid, values, prompt in zip(items.rids, scores, items.prompts, strict=True)
        ]
        return json_response(replies if items.batched else replies[0])

    async def generate(self, request: web.Request) -> web.Response:
        return error_response(
            f"{self.model_path} is a reward model (is_generation false): /generate is not"
            " served here; score token ids or texts with POST /classify"
        )

    # -- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.worker.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.worker.alive:
            return web.Response(status=503)
        if self.worker.busy:
            return web.Response(status=200)  # running requests answer for the model
        try:
            await asyncio.wait_for(self.score([HEALTH_PROBE]), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as err:
            log.error("%s: health probe failed: %r", self.engine_id, err)
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        return self.model_info(
            is_generation=False,
            weight_version=self.weight_version,
            model_type=self.runner.model_type,
            architectures=self.runner.architectures,
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        worker = self.worker
        return self.server_info(
            "fleetrl-embedded-reward",
            is_embedding=True,
            max_running_requests=worker.max_running_requests,
            max_batch_tokens=self.runner.max_batch_tokens,
            context_length=self.runner.max_context,
            weight_version=self.weight_version,
            scored_requests=worker.requests,
            scored_items=worker.items,
            forwards=self.runner.forwards_run,
            internal_states=[worker.load()],
        )

    # -- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load a folder in place (SGLang's reply: success, message, num_paused_requests)."""
        from rollout_fleet.engine.disk_weights import read_checkpoint
        from rollout_fleet.engine.runner import WeightLoadError

        req = await read_body(request, P.UpdateWeightsFromDiskRequest)
        try:
            req.check()
        except ValueError as err:
            raise RequestError(str(err)) from err
        runner = self.runner

        def load() -> int:
            return runner.load_weights(read_checkpoint(req.model_path, runner.named_weights()))

        started = time.perf_counter()
        try:
            count = await asyncio.wrap_future(self.worker.call(load))
        except (WeightLoadError, OSError, RuntimeError) as err:
            log.error("%s: update_weights_from_disk %s failed: %s", self.engine_id, req.model_path, err)  # fmt: skip
            body: dict[str, Any] = {
                "success": False,
                "message": f"Failed to update weights: {err}",
                "num_paused_requests": 0,
            }
            return json_response(body, 400)
        self.model_path = req.model_path
        if req.weight_version is not None:
            self.weight_version = req.weight_version
        message = f"Succeeded to update model weights ({count} tensors)."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        log.info("%s: %s in %.2fs", self.engine_id, message, time.perf_counter() - started)
        return json_response({"success": True, "message": message, "num_paused_requests": 0})
