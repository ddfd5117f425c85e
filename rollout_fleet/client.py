"""Async HTTP client for SGLang's native API, used for both SGLang servers and the
embedded engine (they speak the same protocol, ``rollout_fleet.protocol``).

``EngineClient(base_url, api_key=None, timeout_s=120, retries=2)`` wraps one
``aiohttp.ClientSession`` (created lazily on the caller's event loop). Every
failure is an ``EngineError(engine_url, endpoint, status, message)``; ``status``
is ``None`` when no HTTP answer came back (refused, reset, timed out).

Retry policy (never retry something that may already have had an effect twice):
- read-only and idempotent calls (``health``, ``get_*``, ``pause_generation``,
  ``continue_generation``, ``abort_request``, ``flush_cache``) retry up to
  ``retries`` times on connection errors, timeouts and HTTP 5xx, with backoff;
- ``generate`` retries only when the connection could not be opened (the request
  was never sent); a reset or timeout after sending is raised: the caller decides,
  and resubmitting with the same ``rid`` lets it ``abort_request`` the stray one;
- weight-update calls never retry (they are collectives: a lone retry would hang).

``parse_generate_response`` turns one response object into ``GenerateOutput``
for the rollout workers (with ``top_logprobs``, SGLang's ``output_top_logprobs``
as ``(logprob, token_id)`` rows, when the request asked ``top_logprobs_num``). Per-token versions come from SGLang 0.5.23's
``meta_info.weight_versions`` spans (both SGLang and the embedded engine send
them; a sequence an in-place update landed in has two or more spans). A reply
without spans (an unfinished one) tags every token ``int(weight_version)``.

Streaming (``generate_sample(..., on_partial=)``): ``POST /generate`` with ``stream:
true`` answers SGLang's server-sent events, ``data: {response object}`` per step and
``data: [DONE]``; without SGLang's ``--incremental-streaming-output`` (fleetrl's
launcher never sets it) each object holds the whole output so far, so every event
parses as a ``GenerateOutput`` of the tokens so far, handed to ``on_partial``, until the
one with a finish reason: that is the piece, exactly as a non-streamed reply.

``SyncEngineClient`` runs the same client on a private event-loop thread for
scripts and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
import msgspec

from fleetrl.log import get_logger

log = get_logger(__name__)

RETRY_BACKOFF_S = 0.5
# msgspec's JSON codec: the same bytes as the stdlib's, several times cheaper per request
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()
_JSON_HEADERS = {"Content-Type": "application/json"}


class EngineError(RuntimeError):
    """A request to an engine failed; names the engine, endpoint and HTTP status."""

    def __init__(self, engine_url: str, endpoint: str, status: int | None, message: str) -> None:
        self.engine_url = engine_url
        self.endpoint = endpoint
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"engine {engine_url} {endpoint}: {where}: {message}")


class GenerateOutput(msgspec.Struct, frozen=True):
    """One generated sample, as the rollout workers need it."""

    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    weight_version: str
    prompt_tokens: int
    rid: str = ""
    text: str = ""
    matched_stop: int | str | None = None
    # per output token when asked (top_logprobs_num): [(logprob, token id), ...], highest first
    top_logprobs: list[list[tuple[float, int]]] = msgspec.field(default_factory=list)


PartialCallback = Callable[[GenerateOutput], None]


def _top_rows(rows: Any, num_tokens: int) -> list[list[tuple[float, int]]]:
    """``meta_info.output_top_logprobs`` as ``(logprob, token_id)`` rows, one per token."""
    if rows is None:
        return []
    try:
        out = [[(float(e[0]), int(e[1])) for e in row or ()] for row in rows]
    except (TypeError, ValueError, IndexError) as err:
        raise ValueError(f"bad meta_info.output_top_logprobs {str(rows)[:200]}: {err}") from None
    if len(out) != num_tokens:
        raise ValueError(f"{len(out)} top-logprob rows for {num_tokens} output tokens")
    return out


def parse_generate_response(
    resp: dict[str, Any], *, require_logprobs: bool = True
) -> GenerateOutput:
    """``GenerateOutput`` from one SGLang / embedded-engine response object."""
    try:
        meta = resp["meta_info"]
        output_ids = [int(t) for t in resp["output_ids"]]
        weight_version = str(meta.get("weight_version", ""))
        finish = meta.get("finish_reason") or {}
        entries = meta.get("output_token_logprobs")
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"not an SGLang generate response (missing {err}): {str(resp)[:200]}"
        ) from err
    if entries is None:
        if require_logprobs:
            raise ValueError(
                "generate response has no meta_info.output_token_logprobs: send return_logprob=true"
            )
        logprobs: list[float] = []
    else:
        logprobs = [float(e[0]) for e in entries]
        if len(logprobs) != len(output_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} output tokens")
    versions = token_versions(meta.get("weight_versions"), weight_version, len(output_ids))
    return GenerateOutput(
        output_ids=output_ids,
        logprobs=logprobs,
        token_versions=versions,
        finish_reason=str(finish.get("type", "")),
        weight_version=weight_version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        rid=str(meta.get("id", "")),
        text=str(resp.get("text") or ""),
        matched_stop=finish.get("matched"),
        top_logprobs=_top_rows(meta.get("output_top_logprobs"), len(output_ids)),
    )


async def generate_sample_sglang(
    client: Any,
    input_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    rid: str | None = None,
    lora_path: str | None = None,
    top_logprobs: int = 0,
    on_partial: PartialCallback | None = None,
) -> GenerateOutput:
    """``generate_sample`` for anything with SGLang's ``generate`` (the engine clients and
    test doubles speaking SGLang's format): ``POST /generate``, then its ``GenerateOutput``.
    With ``on_partial`` and a client that has ``generate_stream``, the reply is streamed and
    each event before the last is handed to ``on_partial`` (see the module docstring)."""
    extra: dict[str, Any] = {"lora_path": lora_path} if lora_path is not None else {}
    if top_logprobs:
        extra["top_logprobs_num"] = top_logprobs
    stream = getattr(client, "generate_stream", None)
    if on_partial is None or stream is None:
        reply = await client.generate(
            input_ids, sampling_params, return_logprob=True, rid=rid, **extra
        )
        return parse_generate_response(reply)
    async with contextlib.aclosing(stream(input_ids, sampling_params, rid=rid, **extra)) as events:
        async for event in events:
            output = parse_generate_response(event)
            if output.finish_reason:
                return output
            on_partial(output)
    raise ValueError("the engine's stream ended without a finished response")


def token_versions(spans: Any, weight_version: str, num_tokens: int) -> list[int]:
    """One policy version per output token from ``meta_info.weight_versions`` spans
    (``[{"version", "start", "end"}]`` over output positions); without spans, every token
    gets ``int(weight_version)`` (-1 if that is not an integer). Spans that do not tile
    ``[0, num_tokens)`` are a ValueError naming them."""
    if not spans:
        try:
            tag = int(weight_version)
        except ValueError:
            tag = -1
        return [tag] * num_tokens
    versions: list[int] = []
    try:
        for span in spans:
            start, end, version = int(span["start"]), int(span["end"]), int(span["version"])
            if start != len(versions) or end < start:
                raise ValueError(f"span {span} does not continue at token {len(versions)}")
            versions.extend([version] * (end - start))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad meta_info.weight_versions {str(spans)[:200]}: {err}") from None
    if len(versions) != num_tokens:
        raise ValueError(f"weight_versions spans cover {len(versions)} of {num_tokens} tokens")
    return versions


class EngineClient:
    """Async client for one engine (SGLang or embedded)."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0, retries: int = 2
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self._session: aiohttp.ClientSession | None = None

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(
        self,
        method: str,
        endpoint: str,
        body: dict | None = None,
        *,
        retry: str = "idempotent",
        expect_json: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """``retry``: "idempotent" (connection errors, timeouts, 5xx), "unsent" (connection
        could not be opened only) or "never"."""
        session = await self._get_session()
        url = self.base_url + endpoint
        attempts = 1 + (self.retries if retry != "never" else 0)
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                data = None if body is None else _ENCODER.encode(body)
                async with session.request(
                    method, url, data=data, headers=_JSON_HEADERS if data else None, timeout=timeout
                ) as resp:
                    raw = await resp.read()
                    text = raw.decode("utf-8", errors="replace")
                    if resp.status >= 500 and retry == "idempotent" and not last:
                        await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
                        continue
                    if resp.status >= 400:
                        raise EngineError(
                            self.base_url, endpoint, resp.status, _error_message(text)
                        )
                    if not expect_json:
                        return text
                    return _DECODER.decode(raw) if raw.strip() else None
            except aiohttp.ClientConnectorError as err:  # never reached the server
                if last or retry == "never":
                    raise EngineError(
                        self.base_url, endpoint, None, f"cannot connect: {err}"
                    ) from err
            except (aiohttp.ClientError, TimeoutError) as err:
                if last or retry != "idempotent":
                    raise EngineError(
                        self.base_url, endpoint, None, f"{type(err).__name__}: {err}"
                    ) from err
            except msgspec.DecodeError as err:
                raise EngineError(
                    self.base_url, endpoint, None, f"response is not JSON: {err}"
                ) from err
            await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        raise AssertionError("unreachable")

    # -- generation --------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | list[str] | None = None,
        **extra: Any,
    ) -> dict | list[dict]:
        """``POST /generate``; returns the SGLang response (a list for batches or n > 1)."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            **extra,
        }
        if rid is not None:
            body["rid"] = rid
        return await self._request("POST", "/generate", body, retry="unsent")

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        **extra: Any,
    ) -> AsyncIterator[dict]:
        """``POST /generate`` with ``stream: true`` (one prompt, logprobs on): each event's
        response object, in order, until ``data: [DONE]``. Failures are ``EngineError``s,
        retried only when the connection could not be opened, as ``generate``."""
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                                "return_logprob": True, "stream": True, **extra}  # fmt: skip
        if rid is not None:
            body["rid"] = rid
        session = await self._get_session()
        url = self.base_url + "/generate"
        for attempt in range(1 + self.retries):
            try:
                async with session.post(url, data=_ENCODER.encode(body), headers=_JSON_HEADERS) as resp:  # fmt: skip
                    if resp.status >= 400:
                        text = (await resp.read()).decode("utf-8", errors="replace")
                        raise EngineError(
                            self.base_url, "/generate", resp.status, _error_message(text)
                        )
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        yield _DECODER.decode(data)
                    raise EngineError(
                        self.base_url, "/generate", None, "the stream ended before [DONE]"
                    )
            except aiohttp.ClientConnectorError as err:  # never reached the server
                if attempt == self.retries:
                    raise EngineError(
                        self.base_url, "/generate", None, f"cannot connect: {err}"
                    ) from err
            except (aiohttp.ClientError, TimeoutError) as err:
                raise EngineError(
                    self.base_url, "/generate", None, f"{type(err).__name__}: {err}"
                ) from err
            except msgspec.DecodeError as err:
                raise EngineError(
                    self.base_url, "/generate", None, f"event is not JSON: {err}"
                ) from err
            await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))

    async def generate_batch(
        self, prompts: list[list[int]], sampling_params: dict[str, Any], *, rids: list[str]
    ) -> list[GenerateOutput]:
        """Several samples in one ``POST /generate`` (SGLang's batch form: a list of
        ``input_ids`` and one ``rid`` each), their outputs in order."""
        reply = await self.generate(prompts, sampling_params, return_logprob=True, rid=rids)
        if not isinstance(reply, list) or len(reply) != len(prompts):
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise ValueError(f"a batch of {len(prompts)} prompts was answered with {got}")
        return [parse_generate_response(item) for item in reply]

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
        """One piece of a sample (the engine interface, ``rollout_fleet.engine_api``)."""
        return await generate_sample_sglang(
            self, input_ids, sampling_params, rid=rid, lora_path=lora_path,
            top_logprobs=top_logprobs, on_partial=on_partial,
        )  # fmt: skip

    # -- control -----------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs rid or abort_all=True")
        await self._request(
            "POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, expect_json=False
        )

    async def start_profile(self, output_dir: str, prefix: str = "", gpu: bool = False) -> str:
        """``POST /start_profile``: record a trace (CPU, and GPU if asked) into ``output_dir``."""
        body = {"output_dir": output_dir, "profile_prefix": prefix, "activities": ["CPU", "GPU"] if gpu else ["CPU"]}  # fmt: skip
        return await self._request("POST", "/start_profile", body, retry="never", expect_json=False)  # fmt: skip

    async def stop_profile(self) -> str:
        """``POST /stop_profile``: end the trace; the engine writes it."""
        return await self._request("POST", "/stop_profile", None, retry="never", expect_json=False)  # fmt: skip

    async def flush_cache(self) -> str:
        return await self._request("POST", "/flush_cache", None, expect_json=False)

    async def get_weight_version(self) -> str:
        """The served version, from ``GET /model_info`` (SGLang 0.5.23 has no other route)."""
        return str((await self.get_model_info())["weight_version"])

    async def health(self) -> bool:
        """True when ``/health`` answers 200 (no retries: a health probe should be quick)."""
        try:
            await self._request("GET", "/health", retry="never", expect_json=False, timeout_s=10)
        except EngineError:
            return False
        return True

    async def health_generate(self) -> bool:
        try:
            await self._request("GET", "/health_generate", retry="never", expect_json=False)
        except EngineError:
            return False
        return True

    async def get_model_info(self) -> dict:
        return await self._request("GET", "/model_info")

    async def get_server_info(self) -> dict:
        """``GET /server_info`` (SGLang 0.5.23's name; ``/get_server_info`` is deprecated)."""
        return await self._request("GET", "/server_info")

    # -- memory occupation (co-located engines; never retried: a second release or
    #    resume of the same tags is an error in SGLang) ----------------------------------

    async def release_memory_occupation(self, tags: list[str] | None) -> None:
        """``/release_memory_occupation``: free ``tags`` (None: all); SGLang answers null."""
        await self._request("POST", "/release_memory_occupation", {"tags": tags}, retry="never")

    async def resume_memory_occupation(self, tags: list[str] | None) -> None:
        """``/resume_memory_occupation``: take ``tags`` back (None: all)."""
        await self._request("POST", "/resume_memory_occupation", {"tags": tags}, retry="never")

    # -- weight updates (never retried: they are collectives) ------------------------------

    async def init_weights_update_group(self, **fields: Any) -> dict:
        return await self._request("POST", "/init_weights_update_group", fields, retry="never")

    async def begin_weight_update(self) -> dict:
        return await self._request("POST", "/begin_weight_update", {}, retry="never")

    async def end_weight_update(self) -> dict:
        return await self._request("POST", "/end_weight_update", {}, retry="never")

    async def update_weights_from_distributed(self, **fields: Any) -> dict:
        return await self._request(
            "POST", "/update_weights_from_distributed", fields, retry="never"
        )

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._request(
            "POST", "/destroy_weights_update_group", {"group_name": group_name}, retry="never"
        )


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return text.strip()[:500]


class SyncEngineClient:
    """Blocking facade over ``EngineClient`` (its own event loop on a daemon thread)."""

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-client", daemon=True
        )
        self._thread.start()
        self.client = EngineClient(base_url, **kwargs)

    def _run(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return lambda *a, **k: self._run(method(*a, **k))

    def close(self) -> None:
        self._run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
