"""The bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked.

Fields are OpenAI's. Unknown fields are ignored (clients send ``user``,
``metadata``, ``store``, ``parallel_tool_calls``, ...); fields that would change
the output in a way the fleet cannot honour (penalties, ``logit_bias``, a JSON
``response_format``, a forced ``tool_choice``, ``echo``) are refused with a 400
naming them rather than silently dropped.

Log-probs: chat ``logprobs: true`` reports each generated token's logprob, and
``top_logprobs`` k (0 to 20, OpenAI's bounds; only with ``logprobs: true``, as
OpenAI requires) its k most likely tokens; ``/v1/completions`` ``logprobs`` k (0 to
5, OpenAI's bounds) the sampled token's logprob and the k most likely. Both come
from the distribution the token was sampled from (the run's temperature).

Sampling: training samples at the run's ``rollout.temperature`` / ``top_p`` /
``top_k`` (validation at ``rollout.val_temperature``), whatever a request asks:
the learner recomputes every token's logprob at the run's temperature, so a
token sampled at another would bias every ratio. A request's own values are
accepted and counted (``agent/sampling_overridden``). ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed`` and ``n`` are honoured.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollout_fleet.gateway.errors import ApiError, bad_request

MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # and on /v1/completions logprobs


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    messages: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str | list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = 16
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    echo: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


def decode_body(raw: bytes, struct: type) -> Any:
    if not raw.strip():
        raise bad_request("the request needs a JSON body")
    try:
        return msgspec.json.decode(raw, type=struct)
    except msgspec.ValidationError as err:
        path = str(err).rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in str(err) else None
        raise bad_request(f"invalid request body: {err}", path) from None
    except msgspec.DecodeError as err:
        raise bad_request(f"the body is not JSON: {err}") from None


def _refuse_unsupported(req: Any) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by the fleet's engines", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by the fleet's engines", "logit_bias")
    if not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", "n")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not isinstance(s, str) or not s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of at most 4", "stop")


def check_chat(req: ChatRequest) -> int | None:
    """Refuse what cannot be served; the requested max new tokens (None: the budget's)."""
    _refuse_unsupported(req)
    choice = req.tool_choice
    if choice not in (None, "auto", "none"):
        raise bad_request(
            "tool_choice may be 'auto' or 'none': the policy decides whether to call a tool "
            "(forcing one would train on tokens it did not choose)",
            "tool_choice",
        )
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                "top_logprobs",
            )
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise bad_request("response_format other than text is not supported", "response_format")
    if req.tools is not None and not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in req.tools
    ):
        raise bad_request("tools must be a list of {type: function, function: {...}}", "tools")
    return _max_tokens(req.max_completion_tokens or req.max_tokens)


def check_completion(req: CompletionRequest) -> int | None:
    _refuse_unsupported(req)
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(
            f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {req.logprobs}",
            "logprobs",
        )
    if req.prompt is None or req.prompt in ("", []):
        raise bad_request("prompt must be a non-empty string or list of token ids", "prompt")
    return _max_tokens(req.max_tokens)


def top_logprobs(req: ChatRequest | CompletionRequest) -> int:
    """How many top logprobs per token a checked request asks for (0: none)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else 0
    return req.logprobs or 0


def _max_tokens(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {value}", param="max_tokens")
    return value
