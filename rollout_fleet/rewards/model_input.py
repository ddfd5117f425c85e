"""The reward model's input ids for prompt + response, in the REWARD MODEL's own tokens.

The policy's token ids cannot be sent: a reward model may have another tokenizer
and another chat template (OpenRLHF #242). So the prompt's chat messages (as the
dataset holds them) and the decoded response text are rendered again for the
reward model, as OpenRLHF renders its preference pairs for training and its
remote reward server renders queries at scoring time:

1. text: with the chat template (``apply_chat_template`` on, or ``auto`` and the
   reward model's tokenizer has one) the messages plus the response as an
   assistant turn, ``tokenize=False``; otherwise the prompt's contents joined by
   newlines (as the prompt reader renders a prompt without template) followed by
   the response;
2. EOS as OpenRLHF appends it: trailing newlines stripped, then
   ``" " + eos_token`` unless the text already ends with it (a ChatML template
   ends the assistant turn with ``<|im_end|>``: nothing is added);
3. tokenized without added special tokens (the template carries BOS where the
   model wants one), and cut to the last ``max_length`` tokens: the score is read
   at the last token, so the end of the response (and the EOS) is what must stay.

This must match how the reward model was trained (``fleetrl rm train``): the same
rendering, the same EOS rule. Left out: multimodal prompts; a separate
system prompt for the reward model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol


class RewardTokenizer(Protocol):
    eos_token: str | None
    chat_template: str | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


class RewardModelInputs:
    """Builds reward-model input ids (see the module docstring); counts truncations."""

    def __init__(
        self,
        tokenizer: RewardTokenizer,
        *,
        apply_chat_template: Literal["auto", "on", "off"] = "auto",
        max_length: int,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"reward model max_length must be >= 1, got {max_length}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if apply_chat_template == "on" and not has_template:
            raise ValueError(
                "reward.model.apply_chat_template is 'on' but the reward model's tokenizer has "
                "no chat template; set it to 'off' (prompt text + response) or 'auto'"
            )
        self.tokenizer = tokenizer
        self.chat = apply_chat_template == "on" or (apply_chat_template == "auto" and has_template)
        self.max_length = max_length
        self.num_truncated = 0

    def text(self, messages: Sequence[dict[str, str]] | str, response: str) -> str:
        """The reward model's text for one sample, EOS included."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if self.chat:
            turn = [*messages, {"role": "assistant", "content": response}]
            text = self.tokenizer.apply_chat_template(turn, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in messages) + response
        text = text.rstrip("\n")
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and not text.endswith(eos):
            text += " " + eos
        return text

    def input_ids(self, messages: Sequence[dict[str, str]] | str, response: str) -> list[int]:
        ids = list(self.tokenizer.encode(self.text(messages, response), add_special_tokens=False))
        if len(ids) > self.max_length:
            self.num_truncated += 1
            ids = ids[-self.max_length :]
        return [int(t) for t in ids]
