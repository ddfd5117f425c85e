"""Token ids for a call: the first prompt rendered, later turns appended as template deltas.

Token-in/token-out: an episode's trajectory holds exactly the ids the engine
produced plus the chat template's tokens between them, never a re-tokenisation of
generated text (the drift verl #6719/#6501 and TRL #5242 fixed).

- The first call of a branch renders its messages (and tools) with
  ``fleetrl.data.render.render_chat``, the rendering the dataset's prompts go
  through: an agent that sends a dataset prompt as it is gets the reader's ids.
- A call that extends a recorded conversation reuses its ids and appends
  ``continuation_ids``: the text the template puts after the last generated
  turn's content (the rest of that turn's closing, the new messages, the next
  generation prompt), encoded once, less the closing tokens the policy already
  wrote (its stop token).

Where that text starts is found with a probe, not by diffing two renderings: the
last assistant turn is rendered with ``PROBE`` as its content, and everything
after the probe is the delta. So a template that renders earlier turns
differently once more follow (Qwen3 drops the reasoning of turns before the
last user message) still gives the right delta, and the earlier turns keep the
ids the engine saw: the engine is sent these ids, so what it sees and what the
learner trains on are the same sequence. The earlier turns are rendered with
the generated text as their content (tool-call markup included, as the policy
wrote it), which is what the template would show the model.

``check_template`` refuses, at start, a tokenizer without a chat template or one
that does not render an assistant message's content verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleetrl.data.render import render_chat, render_chat_text
from rollout_fleet.multi_turn.chat_turns import ChatTokenizer

PROBE = "fleetrl-probe-7d1e5a"


class TemplateError(ValueError):
    """The policy's chat template cannot serve the gateway (said at start)."""


class ChatRenderer:
    """Renders an episode's calls with the policy tokenizer's chat template."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)

    def check_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise TemplateError(
                f"tokenizer {self.name!r} has no chat template: the agent gateway renders chat "
                "messages with it"
            )
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": PROBE}]
        text = render_chat_text(self.tokenizer, probe, add_generation_prompt=False)
        if text.count(PROBE) != 1:
            raise TemplateError(
                f"the chat template of {self.name!r} does not render an assistant message's "
                "content verbatim, so generated turns cannot be continued token by token"
            )

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        return render_chat(self.tokenizer, messages, tools)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generated_text(self, turn_ids: Sequence[int]) -> str:
        """A generated turn's text as the chat template shows it again: special tokens out."""
        return self.tokenizer.decode(list(turn_ids), skip_special_tokens=True)

    def continuation_ids(
        self,
        history: Sequence[dict[str, Any]],
        turn_ids: Sequence[int],
        new_messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        """The ids between the generated turn ``turn_ids`` (``history[-1]``) and the next one."""
        if not history or history[-1].get("role") != "assistant":
            raise ValueError("continuation_ids: the history must end with the generated turn")
        probed = [*history[:-1], {"role": "assistant", "content": PROBE}, *new_messages]
        text = render_chat_text(self.tokenizer, probed, add_generation_prompt=True, tools=tools)
        if text.count(PROBE) != 1:
            raise TemplateError(
                f"the chat template of {self.name!r} did not render the generated turn's "
                "content verbatim in this conversation"
            )
        ids = self.encode(text[text.index(PROBE) + len(PROBE) :])
        turn = list(turn_ids)
        written = next(
            k for k in range(min(len(ids), len(turn)), -1, -1) if turn[len(turn) - k :] == ids[:k]
        )
        return ids[written:]
