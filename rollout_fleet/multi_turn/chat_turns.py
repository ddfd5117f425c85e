"""The tokens an environment's reply adds to a multi-turn response, as the chat template renders them.

After a generated turn, the response holds the prompt's tokens and the
policy's own tokens, not a re-tokenised rendering of the conversation (the
learner must train on exactly the tokens that were sampled). An
environment's reply is appended as the tokens the tokenizer's chat template
puts between the end of the policy's turn and the start of the next one:

1. the rest of the assistant turn's closing that the policy did not generate:
   the template renders an assistant message as ``head + content + closing``
   (ChatML: closing = ``<|im_end|>\\n``); when the policy ended its turn with
   a prefix of it (its stop token ``<|im_end|>``), the remainder (``\\n``) is
   added here, and the whole closing when it stopped otherwise (another
   configured stop token);
2. the delta of ``apply_chat_template(messages + [observation],
   add_generation_prompt=True)`` over ``apply_chat_template(messages)``: the
   observation's own turn plus the next generation prompt (ChatML:
   ``<|im_start|>tool\\n<content><|im_end|>\\n<|im_start|>assistant\\n``).

Rendering and encoding are as ``fleetrl.data.render.render_prompt`` does for
a templated prompt (text, then ``encode(add_special_tokens=False)``), so the whole
sequence is the template's rendering of the conversation (up to how the
policy's own tokens would be re-tokenised, and special tokens inside a turn,
which its message text leaves out). A template that
renders earlier turns differently once a message is added (one that drops
past reasoning, say), or that re-renders the policy's turn other than as
generated, cannot be extended by a delta: ``ChatTemplateMismatch`` names the
tokenizer and the sample fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fleetrl.data.render import encode_text
from rollout_fleet.sample_runner import SampleFailed

Message = dict[str, Any]


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class ChatTemplateMismatch(SampleFailed):
    """The chat template cannot be extended turn by turn for this conversation."""


class ChatTurns:
    """Renders conversations with one tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text, from_template=True)

    def assistant_content(self, turn_ids: Sequence[int]) -> str:
        """The assistant message of a generated turn: its text without special tokens."""
        return self.tokenizer.decode(list(turn_ids), skip_special_tokens=True)

    def observation_ids(
        self, messages: Sequence[Message], observation: Message, turn_ids: Sequence[int], uid: str
    ) -> list[int]:
        """Tokens between the generated turn ``turn_ids`` (``messages[-1]``) and the next one."""
        closing = self._unwritten_closing(messages, turn_ids, uid)
        before = self.encode(self.render(messages, generation_prompt=False))
        after = self.encode(self.render([*messages, observation], generation_prompt=True))
        if after[: len(before)] != before:
            raise ChatTemplateMismatch(
                f"sample {uid}: the chat template of tokenizer {self.name!r} renders the "
                f"conversation differently once a {observation.get('role')!r} message is added "
                "(the rendering before it is not a prefix of the rendering after it), so the "
                "reply cannot be appended as a token delta"
            )
        return closing + after[len(before) :]

    def _unwritten_closing(
        self, messages: Sequence[Message], turn_ids: Sequence[int], uid: str
    ) -> list[int]:
        """The tokens of the template's closing of the last assistant turn that the policy
        did not write: all of it after the longest prefix of it that ends ``turn_ids``."""
        head = self.render(messages[:-1], generation_prompt=True)
        rendered = self.render(messages, generation_prompt=False)
        content = str(messages[-1]["content"])
        if not rendered.startswith(head + content):
            raise ChatTemplateMismatch(
                f"sample {uid}: the chat template of tokenizer {self.name!r} does not render the "
                "assistant turn as generation prompt + content, so the environment's reply "
                "cannot follow the generated tokens"
            )
        closing = self.encode(rendered[len(head) + len(content) :])
        turn = list(turn_ids)
        written = next(
            k
            for k in range(min(len(closing), len(turn)), -1, -1)
            if turn[len(turn) - k :] == closing[:k]
        )
        return closing[written:]
