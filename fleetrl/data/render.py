"""How a prompt, and a prompt with its response, become the token ids a model reads.

One rendering serves everything that reads prompts: the policy's prompts (the prompt
reader, so the engines, the learner and the validation log alike), the reward model's
inputs (``fleetrl rm train``, ``fleetrl rm eval``, the RL reward pipeline) and the
OpenAI-compatible gateway. A model scored or trained on ids built another way reads
tokens it never saw (an extra space before the EOS, a template around a plain prompt,
a missing BOS), so no caller builds ids of its own.

A prompt is a plain string or chat messages (``[{"role": ..., "content": ...}, ...]``),
in RL data and in preference data alike. ``chat_template`` says when the tokenizer's
chat template renders chat messages: ``"on"`` (a tokenizer without one is refused with
``ChatTemplateMissing``), ``"off"``, or ``"auto"`` (when the tokenizer has one); a bool
is ``"on"`` / ``"off"``. A plain string is never templated: it is the text the user wrote
(TRL's rule for "standard" and "conversational" data).

Prompts (``render_prompt``): templated messages are rendered with the generation prompt
and encoded without added special tokens (the template writes the BOS a model wants, as
transformers' ``apply_chat_template(tokenize=True)`` encodes); a plain string, or
messages without the template (their contents joined by newlines), is encoded as the
tokenizer encodes text, its special tokens included (a Llama tokenizer's BOS).

Reward-model inputs (``render_reward_input``): the response loses its trailing
whitespace and any end-of-sequence text the policy's decoding left at its end; then

- templated messages: the template renders them followed by one ``assistant`` message
  holding the response (no generation prompt), trailing whitespace dropped (ChatML then
  ends at the ``<|im_end|>`` closing the response), encoded without added special tokens;
- otherwise the prompt text followed directly by the response, encoded as text;

and the EOS id is appended unless the ids already end with it (OpenRLHF's reward
dataset does the same), so the score is always read at an EOS.

Public API: ``render_prompt(tokenizer, prompt, chat_template)`` -> ids; ``prompt_text`` ->
(text, templated); ``render_chat`` / ``render_chat_text`` (the gateway's conversations,
tool calls and the tools offered included, through the same template call);
``render_reward_input``; ``encode_text``; ``prompt_messages``. ``fleetrl.data.reader.render_prompt`` is this one.

Left out: truncation (each caller has its rule: the prompt reader filters or cuts,
``rm train`` drops over-long pairs, scoring keeps the last tokens), multimodal
content, responses of several turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

__all__ = [
    "ChatTemplateMissing", "ChatTemplateMode", "Prompt", "encode_text", "prompt_messages",
    "prompt_text", "render_chat", "render_chat_text", "render_prompt", "render_reward_input",
    "reward_text", "templated",
]  # fmt: skip

Prompt = str | Sequence[Mapping[str, Any]]
ChatTemplateMode = Literal["auto", "on", "off"]
MODES = ("auto", "on", "off")


class Tokenizer(Protocol):
    """What rendering needs of a Hugging Face tokenizer."""

    chat_template: str | None
    eos_token: str | None
    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


class ChatTemplateMissing(ValueError):
    """Chat messages are to be templated and the tokenizer has no chat template."""


def prompt_messages(prompt: Prompt) -> list[dict[str, str]]:
    """The prompt as chat messages (a plain string becomes one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def templated(tokenizer: Tokenizer, prompt: Prompt, chat_template: ChatTemplateMode | bool) -> bool:  # fmt: skip
    """Whether ``prompt`` is rendered with the tokenizer's chat template (module docstring)."""
    mode = ("on" if chat_template else "off") if isinstance(chat_template, bool) else chat_template
    if mode not in MODES:
        raise ValueError(f"chat_template must be one of {MODES} or a bool, got {chat_template!r}")
    if isinstance(prompt, str) or mode == "off":
        return False
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has_template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateMissing(
            f"tokenizer {name} has no chat template to render chat prompts with; give it one "
            "or render prompts as plain text (data.apply_chat_template=false)"
        )
    return has_template


def _plain_text(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt_messages(prompt))


def encode_text(tokenizer: Tokenizer, text: str, *, from_template: bool) -> list[int]:
    """Ids of ``text``: a template's rendering carries its own special tokens; plain text
    gets those the tokenizer adds to any text it encodes (its BOS, for a Llama)."""
    if from_template:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return [int(t) for t in tokenizer.encode(text)]


def prompt_text(
    tokenizer: Tokenizer, prompt: Prompt, chat_template: ChatTemplateMode | bool = "on"
) -> tuple[str, bool]:
    """(the prompt's text as the policy reads it, whether the chat template rendered it)."""
    if templated(tokenizer, prompt, chat_template):
        messages = prompt_messages(prompt)
        return render_chat_text(tokenizer, messages, add_generation_prompt=True), True
    return _plain_text(prompt), False


def render_chat_text(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The chat template's text of ``messages`` as given (an assistant's ``tool_calls``, a
    tool result's ``tool_call_id`` and ``name`` kept) with the ``tools`` offered, if any."""
    extra = {"tools": [dict(tool) for tool in tools]} if tools else {}
    return tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **extra,
    )


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a templated conversation, generation prompt included: the gateway's
    chat calls, rendered as a dataset's chat prompt is (``render_prompt``)."""
    text = render_chat_text(tokenizer, messages, add_generation_prompt=True, tools=tools)
    return encode_text(tokenizer, text, from_template=True)


def render_prompt(
    tokenizer: Tokenizer, prompt: Prompt, chat_template: ChatTemplateMode | bool = "on"
) -> list[int]:
    """Token ids of a policy prompt, generation prompt included (module docstring)."""
    text, from_template = prompt_text(tokenizer, prompt, chat_template)
    return encode_text(tokenizer, text, from_template=from_template)


def clean_response(tokenizer: Tokenizer, response: str) -> str:
    """The response without trailing whitespace or end-of-sequence text."""
    eos = getattr(tokenizer, "eos_token", None)
    text = response.rstrip()
    while eos and text.endswith(eos):
        text = text[: -len(eos)].rstrip()
    return text


def reward_text(
    tokenizer: Tokenizer,
    prompt: Prompt,
    response: str,
    chat_template: ChatTemplateMode | bool = "auto",  # fmt: skip
) -> tuple[str, bool]:
    """(prompt + response as the reward model reads it, before the EOS; whether templated)."""
    response = clean_response(tokenizer, response)
    if templated(tokenizer, prompt, chat_template):
        turn = [*prompt_messages(prompt), {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(turn, tokenize=False).rstrip(), True
    return _plain_text(prompt) + response, False


def render_reward_input(
    tokenizer: Tokenizer,
    prompt: Prompt,
    response: str,
    chat_template: ChatTemplateMode | bool = "auto",  # fmt: skip
) -> list[int]:
    """Token ids a reward model scores for ``prompt`` + ``response``, ending with the EOS
    id when the tokenizer has one (module docstring)."""
    text, from_template = reward_text(tokenizer, prompt, response, chat_template)
    ids = encode_text(tokenizer, text, from_template=from_template)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(int(eos_id))
    return ids
