"""Replies in OpenAI's shapes: chat completions, text completions, models, and SSE framing.

``chat_reply`` / ``completion_reply`` build the JSON the ``openai`` package's
``ChatCompletion`` / ``Completion`` types parse, logprobs included: chat
``choices[].logprobs.content[i]`` = ``{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}, ...]}``, completions ``choices[].logprobs`` = ``{tokens,
token_logprobs, top_logprobs: [{token: logprob}, ...] | null, text_offset}``.
``sse`` frames one event of ``stream: true`` (``rollout_fleet.gateway.streaming``
makes them), ``DONE`` ends a stream.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
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


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(choice: Choice, token_text: Callable[[int], str]) -> dict[str, Any]:
    turn = choice.turn
    tops = turn.top_logprobs or [[] for _ in turn.output_ids]
    content = []
    for token_id, logprob, top in zip(turn.output_ids, turn.logprobs, tops, strict=True):
        entry = _token(token_text(token_id), logprob)
        entry["top_logprobs"] = [_token(token_text(t), lp) for lp, t in top]
        content.append(entry)
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
            tops = None
            if choice.turn.top_logprobs:
                tops = [{logprobs(t): lp for lp, t in top} for top in choice.turn.top_logprobs]
            lp = {"tokens": tokens, "token_logprobs": list(choice.turn.logprobs),
                  "top_logprobs": tops, "text_offset": offsets}  # fmt: skip
        out.append({"index": choice.index, "text": choice.reply.content,
                    "finish_reason": choice.finish_reason, "logprobs": lp})  # fmt: skip
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(choices)}  # fmt: skip


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


def models_reply(model: str) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "fleetrl"}]}  # fmt: skip
