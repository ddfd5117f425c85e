"""A gateway on loopback over scripted engines, for tests that drive it with real clients.

``ScriptedEngine`` speaks SGLang's ``/generate`` response (output ids, logprobs,
``weight_versions`` spans, ``output_top_logprobs`` when ``top_logprobs_num`` is asked)
through the ``GenerateClient`` interface, streamed too (``generate_stream``: SGLang's
cumulative events, one per token): its reply to a request is ``reply(prompt_text)``
encoded by the tokenizer, plus the stop token; it records every request's input ids.
A stream can stop after ``hold_at`` tokens until ``release`` is set, or fail after
``fail_stream_after`` tokens (the next ``stream_failures`` streams). ``GatewayHarness`` runs the real
``SampleRunner`` + ``CallRunner`` + ``AgentGateway`` on an event loop of its own
thread, so synchronous clients (``openai.OpenAI``, LangChain) can call it.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from typing import Any

from rollout_fleet.client import EngineError, generate_sample_sglang
from rollout_fleet.gateway.calls import CallRunner
from rollout_fleet.gateway.episodes import SessionTable
from rollout_fleet.gateway.rendering import ChatRenderer
from rollout_fleet.gateway.server import AgentGateway
from rollout_fleet.router import Router
from rollout_fleet.sample_runner import SampleRunner

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


class ScriptedEngine:
    """Replies ``reply(prompt text)`` + the stop token; versions tagged ``version``."""

    def __init__(self, name: str, tokenizer: Any, reply: Callable[[str], str], version: int = 0):
        self.name = name
        self.base_url = f"http://{name}"
        self.tokenizer = tokenizer
        self.reply = reply
        self.version = version
        self.fail_next = 0  # requests to fail with a connection error before answering
        self.requests: list[dict[str, Any]] = []
        self.outputs: list[list[int]] = []
        self.hold_at: int | None = None  # a stream waits after this many tokens ...
        self.release = threading.Event()  # ... until this is set
        self.streamed = 0  # tokens a stream has sent so far
        self.fail_stream_after: int | None = None  # a stream fails after this many tokens ...
        self.stream_failures = 1  # ... this many times

    generate_sample = generate_sample_sglang  # the engine interface over SGLang's format

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, **extra):
        self.requests.append({"input_ids": list(input_ids), "params": dict(sampling_params),
                              "rid": rid, **extra})  # fmt: skip
        if self.fail_next:
            self.fail_next -= 1
            raise EngineError(self.base_url, "/generate", None, "connection reset")
        await asyncio.sleep(0)
        return self._reply(input_ids, sampling_params, rid, extra.get("top_logprobs_num", 0))

    async def generate_stream(self, input_ids, sampling_params, rid=None, **extra):
        """SGLang's stream: the response so far after each token, the last with its finish."""
        whole = await self.generate(input_ids, sampling_params, rid=rid, **extra)
        n = len(whole["output_ids"])
        fail_after = self.fail_stream_after
        self.stream_failures -= fail_after is not None
        if self.stream_failures <= 0:
            self.fail_stream_after = None
        for k in range(1, n + 1):
            if k == fail_after:
                raise EngineError(self.base_url, "/generate", None, "stream reset")
            if k - 1 == self.hold_at:
                await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
            self.streamed = k
            yield _first(whole, k) if k < n else whole
            await asyncio.sleep(0)

    def _reply(self, input_ids, sampling_params, rid, top: int) -> dict[str, Any]:
        text = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = self.tokenizer.encode(self.reply(text), add_special_tokens=False) + [eos]
        limit = sampling_params["max_new_tokens"]
        finish = "stop" if len(ids) <= limit else "length"
        ids = ids[:limit]
        self.outputs.append(list(ids))
        logprobs = [-0.25 - 0.001 * i for i in range(len(ids))]
        meta = {
            "id": rid,
            "finish_reason": {"type": finish},
            "prompt_tokens": len(input_ids),
            "weight_version": str(self.version),
            "weight_versions": [{"version": self.version, "start": 0, "end": len(ids)}],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
        }
        if top:  # the sampled token first, then the next ids, each less likely
            meta["output_top_logprobs"] = [
                [[lp - j, (t + j) % len(self.tokenizer), None] for j in range(top)]
                for lp, t in zip(logprobs, ids, strict=True)
            ]
        return {"text": "", "output_ids": ids, "meta_info": meta}

    async def abort_request(self, rid=None, abort_all=False):
        return None


def _first(reply: dict[str, Any], k: int) -> dict[str, Any]:
    """``reply`` as a stream shows it after ``k`` tokens (no finish reason yet)."""
    out = copy.deepcopy(reply)
    meta = out["meta_info"]
    out["output_ids"] = out["output_ids"][:k]
    meta["finish_reason"] = None
    meta["weight_versions"] = [{**meta["weight_versions"][0], "end": k}]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = meta[key][:k]
    return out


class GatewayHarness:
    """The gateway stack on a loop of its own thread (see the module docstring)."""

    def __init__(self, tokenizer: Any, engines: list[ScriptedEngine], *, max_new_tokens=256,
                 max_prompt_tokens=512, temperature=1.0, tool_format="hermes"):  # fmt: skip
        self.tokenizer = tokenizer
        self.engines = engines
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1,
                         "max_new_tokens": max_new_tokens,
                         "stop_token_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")]}  # fmt: skip
        self.call(self._build(max_prompt_tokens, tool_format))

    async def _build(self, max_prompt_tokens: int, tool_format: str) -> None:
        router = Router()
        for engine in self.engines:
            router.membership.launch(engine.name, engine.base_url)
            router.membership.weights_loaded(engine.name, 0)
        self.runner = SampleRunner(router, {e.name: e for e in self.engines}, retry_backoff_s=0.01)
        self.sessions = SessionTable()
        self.calls = CallRunner(self.runner, ChatRenderer(self.tokenizer), tool_format=tool_format,
                                max_prompt_tokens=max_prompt_tokens,
                                vocab_size=len(self.tokenizer))  # fmt: skip
        self.gateway = AgentGateway(self.sessions, self.calls, model_name="policy",
                                    token_text=lambda t: self.tokenizer.decode([t]))  # fmt: skip
        self.base_url = await self.gateway.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def open_episode(self, uid: str = "g0/e0"):
        async def open_():
            return self.sessions.open(uid, uid.split("/")[0], self.sampling)

        return self.call(open_())

    def close(self) -> None:
        self.call(self.gateway.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
