"""One call of an episode: from a checked request to generated choices, recorded in its tree.

::

    messages ─► the episode's longest branch they extend (same tools)?
        yes: that branch's ids + the template's delta (rendering.continuation_ids, mask 0)
        no:  a new branch: render_prompt(messages, tools)     (the history was rewritten)
    ─► SampleRunner.generate(episode's group, <episode>/c<k>, ids, sampling)   × n choices
         (routing, failover to another engine with the same ids, abort-resubmit,
          per-token versions: as every sample)
    ─► each choice: a child branch (parent ids + delta + generated ids, mask 1), its text
       parsed for tool calls in the template's format

A streamed call is this same path: ``on_tokens(choice index, ids so far)`` only
watches the tokens arrive (``SampleRunner.generate``'s ``on_tokens``); what is
recorded is what a call without it records.

A branch's response (generated and template tokens) is bounded by the run's
``rollout.max_new_tokens``, a new branch's prompt by ``max_prompt_tokens``: a call
that would exceed either is refused as OpenAI does (400
``context_length_exceeded``), never cut. A call that no engine could serve
(``SampleFailed``) fails its episode: the agent's conversation no longer holds
what the policy said, so nothing of the episode is trained.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_fleet.gateway.episodes import Branch, Episode, fork
from rollout_fleet.gateway.errors import ApiError, bad_request, context_length_exceeded
from rollout_fleet.gateway.messages import ChatMessage, check_messages, tools_key
from rollout_fleet.gateway.rendering import ChatRenderer
from rollout_fleet.gateway.requests import (
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    top_logprobs,
)
from rollout_fleet.gateway.tool_parsers import PARSERS, SENDABLE, ParsedReply
from rollout_fleet.sample_runner import SampleFailed, SampleRunner
from rollout_fleet.trajectory import SampleProgress


@dataclass
class Choice:
    """One generated choice of a call, as the reply reports it."""

    index: int
    turn: SampleProgress  # the call's generated ids, logprobs and versions
    reply: ParsedReply
    finish_reason: str  # stop | length | tool_calls
    prompt_tokens: int


TokensCallback = Callable[[int, list[int]], None]  # (choice index, generated ids so far)


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


class CallRunner:
    """Serves an episode's calls on the fleet (see the module docstring)."""

    def __init__(
        self,
        runner: SampleRunner,
        renderer: ChatRenderer,
        *,
        tool_format: str,
        max_prompt_tokens: int,
        vocab_size: int,
    ) -> None:
        self.runner = runner
        self.renderer = renderer
        self.tool_format = tool_format
        self.parse = PARSERS[tool_format]
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size = vocab_size
        self.calls = 0
        self.failed_calls = 0
        self.refused_context = 0
        self.tool_calls = 0
        self.malformed_tool_calls = 0
        self.sampling_overridden = 0  # calls that asked for another temperature or top_p
        self.call_s = 0.0  # wall time of served calls, gateway included
        self.generate_s = 0.0  # of which the fleet generated (SampleRunner.generate)

    def sendable(self, req: ChatRequest | CompletionRequest) -> Callable[[str], int]:
        """How much of a reply's text a stream may send before the reply is whole."""
        if isinstance(req, ChatRequest) and req.tools and req.tool_choice != "none":
            return SENDABLE[self.tool_format]
        return len

    async def chat(
        self, episode: Episode, req: ChatRequest, on_tokens: TokensCallback | None = None
    ) -> list[Choice]:
        max_tokens = check_chat(req)
        messages = check_messages(req.messages)
        if req.tools and self.tool_format == "none":
            raise bad_request("this policy's chat template offers no tools", "tools")
        keys = [m.key for m in messages]
        rendered = [m.template() for m in messages]
        offered = tools_key(req.tools)
        parent = episode.chat_parent(keys, offered)
        if parent is not None:
            delta = self.renderer.continuation_ids(
                parent.template_messages,
                parent.last_turn_ids,
                rendered[len(parent.keys) :],
                req.tools,
            )
            start = self._extend(parent, delta)
        else:
            start = self._new_branch(self.renderer.prompt_ids(rendered, req.tools), episode)
        parse = self.parse if req.tools and req.tool_choice != "none" else ParsedReply
        choices = await self._run(episode, start, max_tokens, req, parse, on_tokens)
        for choice in choices:
            raw = self.renderer.generated_text(choice.turn.output_ids)
            reply = ChatMessage("assistant", choice.reply.content, choice.reply.tool_calls)
            child = fork(start)
            child.add_turn(choice.turn)
            child.finish(choice.turn.final_finish_reason)
            branch = Branch(child, list(choice.turn.output_ids), [*keys, reply.key],
                            [*rendered, {"role": "assistant", "content": raw}], offered)  # fmt: skip
            episode.add(branch, parent)
        return choices

    async def completion(
        self, episode: Episode, req: CompletionRequest, on_tokens: TokensCallback | None = None
    ) -> list[Choice]:
        max_tokens = check_completion(req)
        ids = list(req.prompt) if isinstance(req.prompt, list) else self.renderer.encode(req.prompt)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"prompt holds token ids outside [0, {self.vocab_size})", "prompt")
        parent = episode.ids_parent(ids)
        if parent is not None:
            start = self._extend(parent, ids[len(parent.ids) :], param="prompt")
        else:
            start = self._new_branch(ids, episode, param="prompt")
        choices = await self._run(episode, start, max_tokens, req, ParsedReply, on_tokens)
        for choice in choices:
            child = fork(start)
            child.add_turn(choice.turn)
            child.finish(choice.turn.final_finish_reason)
            episode.add(Branch(child, list(choice.turn.output_ids), chat=False), parent)
        return choices

    def _extend(self, parent: Branch, delta: list[int], param: str = "messages") -> SampleProgress:
        start = fork(parent.progress)
        if len(delta) >= start.remaining_tokens:
            self.refused_context += 1
            raise context_length_exceeded(
                f"the conversation needs {len(delta)} more tokens before the reply and "
                f"{start.remaining_tokens} of its {start.max_new_tokens}-token budget "
                "(rollout.max_new_tokens) are left: no room for a reply",
                param,
            )
        if delta:
            start.add_env_tokens(delta)
        return start

    def _new_branch(
        self, prompt: list[int], episode: Episode, param: str = "messages"
    ) -> SampleProgress:
        if len(prompt) > self.max_prompt_tokens:
            self.refused_context += 1
            raise context_length_exceeded(
                f"the prompt has {len(prompt)} tokens; at most {self.max_prompt_tokens} "
                "(data.max_prompt_length) start a conversation",
                param,
            )
        return SampleProgress(prompt, episode.sampling["max_new_tokens"])

    def _sampling(self, episode: Episode, req: Any, max_new: int) -> dict[str, Any]:
        base = episode.sampling
        if (req.temperature is not None and req.temperature != base["temperature"]) or (
            req.top_p is not None and req.top_p != base["top_p"]
        ):
            episode.sampling_overridden += 1
            self.sampling_overridden += 1
        params = {**base, "max_new_tokens": max_new}
        if req.stop:
            params["stop"] = _stops(req.stop)
        return params

    async def _run(self, episode: Episode, start: SampleProgress, max_tokens: int | None,
                   req: Any, parse: Any, on_tokens: TokensCallback | None) -> list[Choice]:  # fmt: skip
        max_new = min(max_tokens or start.remaining_tokens, start.remaining_tokens)
        params = self._sampling(episode, req, max_new)
        input_ids = start.resume_input_ids()
        t0 = time.monotonic()
        turns = [SampleProgress(list(input_ids), max_new) for _ in range(req.n)]
        try:
            await asyncio.gather(
                *(
                    self._generate(episode, turn, params, req, i, on_tokens)
                    for i, turn in enumerate(turns)
                )
            )
        except SampleFailed as err:
            self.failed_calls += 1
            episode.fail(f"a call could not be served: {err}")
            raise ApiError(503, f"no engine could serve this call: {err}", type="server_error",
                           code="engine_unavailable") from None  # fmt: skip
        self.generate_s += time.monotonic() - t0
        self.calls += 1
        stops = _stops(req.stop)
        return [self._choice(i, turn, len(input_ids), stops, parse, episode) for i, turn in enumerate(turns)]  # fmt: skip

    async def _generate(self, episode: Episode, turn: SampleProgress, params: dict[str, Any],
                        req: Any, index: int, on_tokens: TokensCallback | None) -> None:  # fmt: skip
        if req.seed is not None:
            params = {**params, "sampling_seed": req.seed + index}
        watch = None if on_tokens is None else (lambda ids: on_tokens(index, ids))
        await self.runner.generate(episode.group_id, episode.next_call_uid(), turn, params,
                                   top_logprobs=top_logprobs(req), on_tokens=watch)  # fmt: skip

    def _choice(self, index: int, turn: SampleProgress, prompt_tokens: int, stops: list[str],
                parse: Any, episode: Episode) -> Choice:  # fmt: skip
        text = self.renderer.generated_text(turn.output_ids)
        for stop in stops:
            if turn.final_finish_reason == "stop" and text.endswith(stop):
                text = text[: -len(stop)]
                break
        reply = parse(text)
        if reply.malformed:
            self.malformed_tool_calls += 1
            episode.malformed_tool_calls += 1
        self.tool_calls += len(reply.tool_calls)
        finish = "tool_calls" if reply.tool_calls else turn.final_finish_reason
        if index == 0:
            episode.last_reply = reply.content
        return Choice(index, turn, reply, finish, prompt_tokens)

    def stats(self) -> dict[str, float]:
        return {
            "agent/gateway_calls": float(self.calls),
            "agent/gateway_failed_calls": float(self.failed_calls),
            "agent/gateway_context_refusals": float(self.refused_context),
            "agent/tool_calls": float(self.tool_calls),
            "agent/tool_calls_malformed": float(self.malformed_tool_calls),
            "agent/sampling_overridden": float(self.sampling_overridden),
        }
