"""Replies in OpenAI's shapes: chat completions, text completions, models, and their SSE chunks.

``chat_reply`` / ``completion_reply`` build the JSON the ``openai`` package's
``ChatCompletion`` / ``Completion`` types parse; ``chat_chunks`` /
``completion_chunks`` the ``chat.completion.chunk`` / ``text_completion`` events
of ``stream: true`` (a role chunk, the content, each tool call, the finish
reason, usage when ``stream_options.include_usage``), framed by ``sse`` and
ended by ``data: [DONE]``. A streamed reply is sent once the call's tokens are
generated (they come through the same failover path as every sample), so its
first chunk arrives with the last.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from rollout_fleet.gateway.calls import Choice

DONE = b"data: [DONE]\n\n"


def reply_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(choices: list[Choice]) -> dict[str, int]:
    prompt = choices[0].prompt_tokens if choices else 0
    completion = sum(len(c.turn.output_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _tool_calls(choice: Choice) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in choice.reply.tool_calls
    ]


def chat_logprobs(choice: Choice, token_text: Callable[[int], str]) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(choice.turn.output_ids, choice.turn.logprobs, strict=True):
        text = token_text(token_id)
        content.append({"token": text, "logprob": logprob,
                        "bytes": list(text.encode("utf-8")), "top_logprobs": []})  # fmt: skip
    return {"content": content, "refusal": None}


def chat_reply(rid: str, model: str, choices: list[Choice], logprobs: Callable | None) -> dict:
    out = []
    for choice in choices:
        message: dict[str, Any] = {"role": "assistant", "content": choice.reply.content or None}
        if choice.reply.tool_calls:
            message["tool_calls"] = _tool_calls(choice)
        elif message["content"] is None:
            message["content"] = ""
        out.append({
            "index": choice.index,
            "message": message,
            "finish_reason": choice.finish_reason,
            "logprobs": chat_logprobs(choice, logprobs) if logprobs else None,
        })  # fmt: skip
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(choices)}  # fmt: skip


def completion_reply(
    rid: str, model: str, choices: list[Choice], logprobs: Callable | None
) -> dict:
    out = []
    for choice in choices:
        lp = None
        if logprobs:
            tokens = [logprobs(t) for t in choice.turn.output_ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            lp = {"tokens": tokens, "token_logprobs": list(choice.turn.logprobs),
                  "top_logprobs": None, "text_offset": offsets}  # fmt: skip
        out.append({"index": choice.index, "text": choice.reply.content,
                    "finish_reason": choice.finish_reason, "logprobs": lp})  # fmt: skip
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(choices)}  # fmt: skip


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


def chat_chunks(reply: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    head = {k: reply[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    for choice in reply["choices"]:
        index, message = choice["index"], choice["message"]

        def chunk(delta: dict[str, Any], finish: str | None = None, *, i: int = index) -> dict:
            return {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                         "logprobs": None}]}  # fmt: skip

        yield chunk({"role": "assistant", "content": ""})
        if message.get("content"):
            yield chunk({"content": message["content"]})
        for k, call in enumerate(message.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": k, **call}]})
        yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": reply["usage"]}


def completion_chunks(reply: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    head = {k: reply[k] for k in ("id", "object", "created", "model")}
    for choice in reply["choices"]:
        yield {**head, "choices": [{**choice, "finish_reason": None, "logprobs": None}]}
        yield {**head, "choices": [{"index": choice["index"], "text": "",
                                    "finish_reason": choice["finish_reason"], "logprobs": None}]}  # fmt: skip
    if include_usage:
        yield {**head, "choices": [], "usage": reply["usage"]}


def models_reply(model: str) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "fleetrl"}]}  # fmt: skip
