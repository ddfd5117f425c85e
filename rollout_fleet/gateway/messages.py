"""A chat request's messages, checked once, in the two forms the gateway needs.

``check_messages`` turns OpenAI's message list into ``ChatMessage``s (one line per
mistake, naming ``messages[i].field``): roles ``system`` / ``developer`` (rendered
as ``system``) / ``user`` / ``assistant`` / ``tool``; content a string, null, or a
list of text parts (other parts, such as images, are refused); an assistant's
``tool_calls`` as OpenAI sends them back (``id``, ``function.name``,
``function.arguments`` as a JSON string).

- ``ChatMessage.key`` compares a call's history with what an episode recorded:
  role, text, tool calls by name and parsed arguments (ids and JSON spacing are
  left out: clients re-serialise them), the tool message's ``tool_call_id``.
- ``ChatMessage.template`` is what the chat template renders: ``role`` and
  ``content`` plus ``name`` / ``tool_call_id``, and ``tool_calls`` with
  arguments as a dict (Hugging Face templates serialise them themselves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rollout_fleet.gateway.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class FunctionCall:
    """One tool call: its id, the function's name and its arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        try:
            return json.loads(self.arguments)
        except (TypeError, ValueError):
            return self.arguments


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[FunctionCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    key: tuple = field(init=False, compare=False)

    def __post_init__(self) -> None:
        calls = tuple(
            (c.name, json.dumps(c.parsed_arguments(), sort_keys=True)) for c in self.tool_calls
        )
        object.__setattr__(
            self, "key", (self.role, self.content, calls, self.tool_call_id, self.name)
        )

    def template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.parsed_arguments()},
                }
                for c in self.tool_calls
            ]
        return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}.content[{j}] is a {kind!r} part: only text parts are supported",
                    f"{where}.content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string, null or a list of text parts", where)


def _tool_calls(raw: Any, where: str) -> tuple[FunctionCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls[{j}]"
            )
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(FunctionCall(str(call.get("id", "")), function["name"], arguments))
    return tuple(calls)


def check_message(raw: Any, where: str) -> ChatMessage:
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", where)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", where)
    name = raw.get("name") or ""
    if not isinstance(name, str):
        raise bad_request(f"{where}.name must be a string", f"{where}.name")
    tool_call_id = raw.get("tool_call_id") or ""
    if role == "tool" and not isinstance(tool_call_id, str):
        raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    return ChatMessage(
        role="system" if role == "developer" else role,
        content=_text(raw.get("content"), where),
        tool_calls=_tool_calls(raw.get("tool_calls"), where) if role == "assistant" else (),
        tool_call_id=tool_call_id if role == "tool" else "",
        name=name,
    )


def check_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    return [check_message(message, f"messages[{i}]") for i, message in enumerate(raw)]


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    """The offered tools as one comparable string (a branch continues only with the same)."""
    return json.dumps(tools or [], sort_keys=True)
