"""Tool calls parsed from the policy's own text, in its chat template's format.

- ``hermes`` (Qwen2.5, Hermes, Qwen3): each call is ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``; text outside the tags is the content (trailing
  whitespace dropped).
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted), optionally after
  ``<|python_tag|>``; several calls are separated by ``;``.
- ``none``: the template offers no tools; every reply is content.

``detect_tool_format(chat_template)`` reads the template's source for the markers
SGLang's and vLLM's parsers key on; a template with none of them is refused at
start (``UnknownToolFormat``) unless ``rollout.agent.tool_format`` names one.

``SENDABLE[format](text)``: how much of a reply's text so far a stream may send as
content, holding back whatever could still turn out to be a tool call: hermes sends
up to the first ``<tool_call>`` (or a suffix that may be its start), less trailing
whitespace; llama3_json holds a reply that starts (after whitespace) with ``{`` or
``<|python_tag|>``, or may still. What is sent is then always the start of the
content ``PARSERS`` gives for the whole reply.

A reply whose tool-call markup does not parse (bad JSON, no name, an unclosed
tag) comes back whole as content with no tool calls, and counts as ``malformed``:
the policy wrote it, so it is trained on like any other text, and the reward
judges what the agent did with it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_fleet.gateway.messages import FunctionCall

TOOL_FORMATS = ("hermes", "llama3_json", "none")
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


class UnknownToolFormat(ValueError):
    """A chat template whose tool-call format the gateway cannot parse."""


@dataclass(frozen=True)
class ParsedReply:
    content: str
    tool_calls: tuple[FunctionCall, ...] = ()
    malformed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(obj: Any, argument_keys: tuple[str, ...]) -> FunctionCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(new_call_id(), obj["name"], json.dumps(arguments))


def parse_hermes(text: str) -> ParsedReply:
    blocks = _HERMES_RE.findall(text)
    rest = _HERMES_RE.sub("", text)
    if not blocks:
        return ParsedReply(text, malformed="<tool_call>" in text)
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block.strip()), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None or "<tool_call>" in rest:
            return ParsedReply(text, malformed=True)
        calls.append(call)
    return ParsedReply(rest.rstrip(), tuple(calls))


def parse_llama3_json(text: str) -> ParsedReply:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return ParsedReply(text, malformed=tagged)
    calls = []
    for piece in (p for p in body.split(";") if p.strip()):
        try:
            call = _call(json.loads(piece), ("parameters", "arguments"))
        except ValueError:
            call = None
        if call is None:
            return ParsedReply(text, malformed=True)
        calls.append(call)
    return ParsedReply("", tuple(calls))


def parse_none(text: str) -> ParsedReply:
    return ParsedReply(text)


PARSERS: dict[str, Callable[[str], ParsedReply]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "none": parse_none,
}


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a start of ``marker`` (all of it too)."""
    for size in range(min(len(marker), len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def sendable_hermes(text: str) -> int:
    at = text.find("<tool_call>")
    end = at if at >= 0 else len(text) - partial_suffix(text, "<tool_call>")
    return len(text[:end].rstrip())


def sendable_llama3_json(text: str) -> int:
    body = text.lstrip()
    if (
        not body
        or body.startswith("{")
        or body.startswith(_PYTHON_TAG)
        or _PYTHON_TAG.startswith(body)
    ):
        return 0
    return len(text)


SENDABLE: dict[str, Callable[[str], int]] = {
    "hermes": sendable_hermes,
    "llama3_json": sendable_llama3_json,
    "none": len,
}


def detect_tool_format(chat_template: str | None, where: str) -> str:
    """The tool format of ``chat_template``; ``UnknownToolFormat`` names ``where`` if none."""
    source = chat_template or ""
    if "<tool_call>" in source:
        return "hermes"
    if _PYTHON_TAG in source or "ipython" in source:
        return "llama3_json"
    raise UnknownToolFormat(
        f"the chat template of {where} has no tool-call format the gateway parses (hermes "
        "<tool_call>, llama3 JSON); set rollout.agent.tool_format to hermes, llama3_json or "
        "none (none: tools are refused)"
    )
