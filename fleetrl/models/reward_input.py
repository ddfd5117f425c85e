"""The token sequence a reward model scores: a prompt and one response, rendered one way.

``fleetrl rm train`` trains on these sequences and whatever scores a response with the
trained model (the rollout's reward pipeline, ``fleetrl rm eval``) must build the very
same ones, or the scores it reads are of inputs the model never saw. The rule:

- chat prompts (a list of ``{role, content}`` messages, as the RL data holds them) with
  ``apply_chat_template``: the tokenizer's template renders the messages followed by one
  ``assistant`` message holding the response (no generation prompt), trailing whitespace
  dropped — ChatML then ends at the ``<|im_end|>`` that closes the response;
- plain-string prompts, or chat prompts without a template: the prompt text (messages'
  contents joined by newlines) followed directly by the response text;
- then the end-of-sequence token is appended unless the sequence already ends with it
  (OpenRLHF's reward dataset does the same), so the score is always read at an EOS the
  model has learned to summarise the whole response in.

A response that still carries the policy's own end marker as text (decoded without
skipping special tokens) has it removed first, so it is not closed twice.

Left out: truncation (callers drop or clip over-long sequences by their own rule) and
multi-turn responses (the response is one assistant message).
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, str]]


def prompt_messages(prompt: Prompt) -> list[dict[str, str]]:
    """The prompt as chat messages (a plain string becomes one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def reward_text(
    tokenizer: Any, prompt: Prompt, response: str, *, apply_chat_template: bool = True
) -> str:
    """The text of prompt + response as the reward model reads it (before the EOS rule)."""
    eos = getattr(tokenizer, "eos_token", None)
    if eos and response.endswith(eos):
        response = response[: -len(eos)]
    template = getattr(tokenizer, "chat_template", None)
    if apply_chat_template and template and not isinstance(prompt, str):
        messages = [*prompt_messages(prompt), {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return text.rstrip()
    if isinstance(prompt, str):
        return prompt + response
    return "\n".join(m["content"] for m in prompt_messages(prompt)) + response


def reward_token_ids(
    tokenizer: Any, prompt: Prompt, response: str, *, apply_chat_template: bool = True
) -> list[int]:
    """Token ids of prompt + response, ending with the tokenizer's EOS when it has one."""
    text = reward_text(tokenizer, prompt, response, apply_chat_template=apply_chat_template)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(int(eos_id))
    return ids
