"""``stream: true``: a call's reply as server-sent events while its tokens are generated.

The call runs as it does unstreamed (``CallRunner.chat`` / ``completion``, one
recording path); ``on_tokens(choice, ids so far)`` lets ``ReplyStream`` watch the
tokens arrive (the engines' clients stream where their API does: SGLang's
``/generate``; a vLLM piece arrives whole). Each time more arrive, a choice's text
is decoded again and the part that is now sure is sent as a delta:

- never a partial UTF-8 character (the decoded text's trailing U+FFFD is held);
- never what could still be a tool call in the template's format, nor the
  whitespace before it (``tool_parsers.SENDABLE``);
- never what could still be the start of a ``stop`` string (it is cut from the reply).

When the call is done, each choice's rest of the content (the reply's parsed content
less what was sent), its tool calls as ``tool_calls`` deltas, and its finish chunk
(with the whole call's ``logprobs`` when asked) follow; then usage when
``stream_options.include_usage``. What was sent is always the start of that content,
so the concatenated deltas equal an unstreamed reply's content.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.gateway.calls import Choice
from rollout_fleet.gateway.replies import chat_logprobs, completion_reply, usage
from rollout_fleet.gateway.tool_parsers import partial_suffix

log = get_logger(__name__)

REPLACEMENT = "\ufffd"  # what a partial UTF-8 character decodes as


class ReplyStream:
    """The events of one streamed call, chat (``chat.completion.chunk``) or text completion."""

    def __init__(self, *, chat: bool, rid: str, model: str, n: int,
                 text_of: Callable[[list[int]], str], sendable: Callable[[str], int],
                 stops: list[str], token_text: Callable[[int], str] | None,
                 include_usage: bool) -> None:  # fmt: skip
        self.chat = chat
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}  # fmt: skip
        self.text_of = text_of
        self.sendable = sendable
        self.stops = stops
        self.token_text = token_text
        self.include_usage = include_usage
        self.sent = [""] * n
        self.mismatches = 0  # choices whose final content did not start with what was sent

    def _chunk(self, index: int, delta: dict[str, Any] | str, finish: str | None = None,
               logprobs: Any = None) -> dict[str, Any]:  # fmt: skip
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": logprobs}
        return {**self.head, "choices": [choice]}

    def opening(self) -> list[dict[str, Any]]:
        """The role chunk of every chat choice (completions open with their first text)."""
        if not self.chat:
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.sent))]

    def _safe(self, text: str) -> str:
        end = len(text.rstrip(REPLACEMENT))
        end = min(end, self.sendable(text[:end]))
        for stop in self.stops:
            end = min(end, len(text[:end]) - partial_suffix(text[:end], stop))
        return text[:end]

    def tokens(self, index: int, ids: list[int]) -> list[dict[str, Any]]:
        """The delta of choice ``index`` now that ``ids`` are generated (none or one event)."""
        safe = self._safe(self.text_of(ids))
        sent = self.sent[index]
        if len(safe) <= len(sent) or not safe.startswith(sent):
            return []  # nothing new is sure yet (or the decoding changed: wait for the end)
        self.sent[index] = safe
        return [self._content(index, safe[len(sent) :])]

    def _content(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(index, {"content": text} if self.chat else text)

    def closing(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Each choice's rest, tool calls and finish; usage if asked."""
        events = []
        for choice in choices:
            content, sent = choice.reply.content, self.sent[choice.index]
            if not content.startswith(sent):
                self.mismatches += 1
                log.warning("streamed choice %d: the reply's content does not start with the "
                            "%d characters sent; its rest is not sent", choice.index, len(sent))  # fmt: skip
            elif len(content) > len(sent):
                events.append(self._content(choice.index, content[len(sent) :]))
            for k, call in enumerate(choice.reply.tool_calls):
                function = {"name": call.name, "arguments": call.arguments}
                delta = {"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                         "function": function}]}  # fmt: skip
                events.append(self._chunk(choice.index, delta))
            events.append(self._chunk(choice.index, {} if self.chat else "",
                                      choice.finish_reason, self._logprobs(choice)))  # fmt: skip
        if self.include_usage:
            events.append({**self.head, "choices": [], "usage": usage(choices)})
        return events

    def _logprobs(self, choice: Choice) -> dict[str, Any] | None:
        if self.token_text is None:
            return None
        if self.chat:
            return chat_logprobs(choice, self.token_text)
        reply = completion_reply("", "", [choice], self.token_text)
        return reply["choices"][0]["logprobs"]
