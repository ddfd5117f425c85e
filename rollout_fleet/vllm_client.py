"""The rollout engine interface over vLLM 0.34's HTTP API (``vllm serve`` in dev mode).

``VllmEngineClient`` is ``rollout_fleet.client.EngineClient`` (same session, retries, errors,
bearer key) with vLLM's routes behind the same methods, so the sample runner, the fleet's
health checks and co-location drive either engine alike (``rollout_fleet.engine_api``):

- ``generate_sample``: ``POST /v1/completions`` with the prompt as token ids, ``logprobs:
  0`` (the sampled token's only; ``k`` with ``return_tokens_as_token_ids`` when
  ``top_logprobs`` = k is asked, whose ``top_logprobs`` dicts, keyed ``token_id:<id>``,
  become the k largest ``(logprob, id)``), ``return_token_ids`` and ``return_weight_versions``;
  the reply's ``choices[0].token_ids``, ``logprobs.token_logprobs`` and ``weight_versions``
  (spans ``{version, start, end}`` over output tokens, as SGLang's) become the same
  ``GenerateOutput`` as SGLang's. vLLM labels each output token with the version its engine
  core reported in the step that produced it (``OutputProcessor.track_weight_version``), so
  a sequence an in-place update landed in has one span per version. ``request_id`` is the
  runner's ``rid``; vLLM names the request ``cmpl-<rid>-0``, which ``abort_request`` uses.
  A LoRA adapter is chosen by ``model`` (its name); otherwise the served model name.
  While paused in ``abort`` mode vLLM refuses new requests unrun with HTTP 503 (its
  ``RetryableRequestError``; SGLang queues them instead): the request is sent again every
  ``PAUSED_RETRY_S`` until it is taken or the client's ``timeout_s`` has passed.
  ``on_partial`` is not called: a piece is one non-streamed reply (vLLM sends its
  ``weight_versions`` only in a stream's last chunk, so a partial could not carry the
  versions a kept partial needs), and a streaming gateway sends it when it is whole.
- ``pause_generation(mode)``: ``POST /pause?mode=``: ``in_place`` → ``keep`` (requests stay,
  with their KV, and continue on the new weights: later tokens carry the new version),
  ``abort`` → ``abort`` (in-flight requests end with finish reason ``abort`` and their
  tokens so far; the runner resubmits prompt + prefix), ``retract`` → ``abort`` too: vLLM
  has no retract, and resubmitting prompt + prefix recomputes the KV after the update, which
  is what retract does inside SGLang. ``continue_generation``: ``POST /resume``.
- ``release_memory_occupation(tags)``: ``POST /sleep?level=2`` when ``weights`` is released
  (weights and KV discarded: the next push restores them), ``level=1`` otherwise (KV
  discarded, weights kept in host memory); ``resume_memory_occupation(tags)``: ``POST
  /wake_up?tags=...`` with vLLM's tags (``weights``, ``kv_cache``; SGLang's ``cuda_graph``
  has no vLLM counterpart and is dropped).
- ``get_weight_version``: ``GET /weight_info``; ``flush_cache``: ``POST /reset_prefix_cache``;
  ``health``: ``GET /health`` (with the key: fleetrl's middleware guards every route).

Every body here is parsed by vLLM's own request models in the conformance tier
(tests/conformance/vllm).
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from rollout_fleet.client import (
    EngineClient,
    EngineError,
    GenerateOutput,
    PartialCallback,
    token_versions,
)
from rollout_fleet.vllm_launcher import SERVED_MODEL_NAME
from weight_sync.vllm_engine_client import PAUSE_MODES

_VLLM_MEMORY_TAGS = ("weights", "kv_cache")
PAUSED_RETRY_S = 0.1  # between sends of a request a paused engine refused
# SGLang-style sampling parameters -> vLLM completion fields
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
    "stop_token_ids": "stop_token_ids",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
}


def completion_request(
    input_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    rid: str | None = None,
    lora_path: str | None = None,
    top_logprobs: int = 0,
) -> dict[str, Any]:
    """The ``/v1/completions`` body of one sample's piece (SGLang-style sampling params in)."""
    unknown = set(sampling_params) - set(_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"sampling parameters vLLM is not sent: {sorted(unknown)}")
    body: dict[str, Any] = {
        "model": lora_path or SERVED_MODEL_NAME,
        "prompt": [int(t) for t in input_ids],
        "logprobs": 0,
        "return_token_ids": True,
        "return_weight_versions": True,
        "skip_special_tokens": False,
    }
    for ours, theirs in _SAMPLING_FIELDS.items():
        if ours in sampling_params:
            body[theirs] = sampling_params[ours]
    if rid is not None:
        body["request_id"] = rid
    if top_logprobs:
        body["logprobs"] = top_logprobs
        body["return_tokens_as_token_ids"] = True
    return body


def _top_rows(entries: Any, top_logprobs: int) -> list[list[tuple[float, int]]]:
    """vLLM's ``logprobs.top_logprobs`` (per token ``{"token_id:<id>": logprob}``, the k
    largest plus the sampled token) as the ``top_logprobs`` largest ``(logprob, id)`` rows."""
    rows = []
    for entry in entries:
        pairs = [(float(lp), int(key.rpartition(":")[2])) for key, lp in (entry or {}).items()]
        rows.append(sorted(pairs, key=lambda p: -p[0])[:top_logprobs])
    return rows


def parse_completion(reply: dict[str, Any], rid: str = "", top_logprobs: int = 0) -> GenerateOutput:
    """``GenerateOutput`` from one ``/v1/completions`` reply of vLLM (one choice)."""
    try:
        choice = reply["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        spans = choice.get("weight_versions")
        finish = str(choice.get("finish_reason") or "")
        prompt_tokens = len(reply.get("prompt_token_ids") or choice.get("prompt_token_ids") or [])
        tops = _top_rows(choice["logprobs"]["top_logprobs"], top_logprobs) if top_logprobs else []
    except (KeyError, TypeError, IndexError, ValueError) as err:
        raise ValueError(
            f"not a vLLM completion reply (missing {err}): {str(reply)[:200]}"
        ) from None
    if len(logprobs) != len(output_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} output tokens")
    last = str(spans[-1]["version"]) if spans else ""
    return GenerateOutput(
        output_ids=output_ids,
        logprobs=logprobs,
        token_versions=token_versions(spans, last, len(output_ids)),
        finish_reason=finish,
        weight_version=last,
        prompt_tokens=prompt_tokens,
        rid=rid,
        text=str(choice.get("text") or ""),
        matched_stop=choice.get("stop_reason"),
        top_logprobs=tops,
    )


def request_name(rid: str) -> str:
    """The name vLLM's completion server gives request ``rid`` (its one choice)."""
    return f"cmpl-{rid}-0"


class VllmEngineClient(EngineClient):
    """``EngineClient``'s interface on vLLM's routes (see the module docstring)."""

    async def generate_sample(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        lora_path: str | None = None,
        top_logprobs: int = 0,
        on_partial: PartialCallback | None = None,
    ) -> GenerateOutput:
        body = completion_request(
            input_ids, sampling_params, rid=rid, lora_path=lora_path, top_logprobs=top_logprobs
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                reply = await self._request("POST", "/v1/completions", body, retry="unsent")
                return parse_completion(reply, rid or "", top_logprobs)
            except EngineError as err:
                # 503: vLLM refused it unrun (paused for a weight update): send it again
                if err.status != HTTPStatus.SERVICE_UNAVAILABLE or loop.time() > deadline:
                    raise
            await asyncio.sleep(PAUSED_RETRY_S)

    async def pause_generation(self, mode: str = "abort") -> dict:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; accepted: {sorted(PAUSE_MODES)}")
        return await self._request("POST", f"/pause?mode={PAUSE_MODES[mode]}", None)

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/resume", None)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs rid or abort_all=True")
        body = {} if abort_all else {"request_ids": [request_name(rid or "")]}
        await self._request("POST", "/abort_requests", body)

    async def flush_cache(self) -> str:
        return await self._request("POST", "/reset_prefix_cache", None, expect_json=False)

    async def get_weight_version(self) -> str:
        return str((await self._request("GET", "/weight_info"))["weight_version"])

    async def get_model_info(self) -> dict:
        """What SGLang's ``/model_info`` gives fleetrl: the served weight version."""
        return {"weight_version": await self.get_weight_version()}

    async def release_memory_occupation(self, tags: list[str] | None) -> None:
        level = 2 if tags is None or "weights" in tags else 1
        await self._request("POST", f"/sleep?level={level}", None, retry="never")

    async def resume_memory_occupation(self, tags: list[str] | None) -> None:
        wanted = _VLLM_MEMORY_TAGS if tags is None else [t for t in tags if t in _VLLM_MEMORY_TAGS]
        if not wanted:
            return  # only SGLang's cuda_graph: nothing of vLLM's to wake
        query = "&".join(f"tags={t}" for t in wanted)
        await self._request("POST", f"/wake_up?{query}", None, retry="never")

    async def start_profile(self, output_dir: str, prefix: str = "", gpu: bool = False) -> str:
        """vLLM's ``/start_profile``, which vLLM registers only when launched with
        ``--profiler-config`` (its trace folder fixed at launch). fleetrl's launcher passes
        none, so a vLLM engine answers 404 here and the roles log it: profiling is best
        effort, and vLLM engines are not profiled."""
        return await self._request("POST", "/start_profile", None, retry="never", expect_json=False)  # fmt: skip

    async def health_generate(self) -> bool:
        return await self.health()
