"""The reward model's input ids for prompt + response, in the REWARD MODEL's own tokens.

The policy's token ids cannot be sent: a reward model may have another tokenizer
and another chat template (OpenRLHF #242). So the prompt (chat messages or a plain
string, as the dataset holds it) and the decoded response text are rendered again for
the reward model by ``fleetrl.data.render.render_reward_input``, the one rendering
``fleetrl rm train`` trained it on and ``fleetrl rm eval`` reads it with: the same
template rule (``reward.model.apply_chat_template``), the same EOS rule.

Inputs longer than ``max_length`` keep their last tokens: the score is read at the last
token, so the end of the response (and the EOS) is what must stay; they are counted.
Left out: multimodal prompts; a separate system prompt for the reward model.
"""

from __future__ import annotations

from typing import Literal

from fleetrl.data.render import ChatTemplateMissing, Prompt, Tokenizer, render_reward_input


class RewardModelInputs:
    """Builds reward-model input ids (see the module docstring); counts truncations."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        apply_chat_template: Literal["auto", "on", "off"] = "auto",
        max_length: int,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"reward model max_length must be >= 1, got {max_length}")
        if apply_chat_template == "on" and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateMissing(
                "reward.model.apply_chat_template is 'on' but the reward model's tokenizer has "
                "no chat template; set it to 'off' (prompt text + response) or 'auto'"
            )
        self.tokenizer = tokenizer
        self.chat_template = apply_chat_template
        self.max_length = max_length
        self.num_truncated = 0

    def input_ids(self, prompt: Prompt, response: str) -> list[int]:
        ids = render_reward_input(self.tokenizer, prompt, response, self.chat_template)
        if len(ids) > self.max_length:
            self.num_truncated += 1
            ids = ids[-self.max_length :]
        return ids
