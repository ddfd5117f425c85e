"""The model a TP rank holds: a Hugging Face causal LM (or, for a reward-model folder, its
``*ForSequenceClassification``) behind SGLang's model interface.

SGLang's weight-update code calls ``model.load_weights(named_tensors)`` (HF names,
full tensors) and ``model.get_weights_by_name(name, truncate_size, tp_size)``;
this adapter gives a ``transformers`` model those two methods. Every TP rank
holds a full copy: sharding is not what the protocol tests exercise. LoRA
adapters (``lora.LoraAdapters``) wrap the same model with peft once one is
loaded, so an engine that loads adapters takes no full-weight updates after.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from sglang.srt.model_loader.weight_utils import default_weight_loader

from .lora import LoraAdapters

logger = logging.getLogger(__name__)


class HFModelAdapter(torch.nn.Module):
    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        self.lora = LoraAdapters(hf_model)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> HFModelAdapter:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        from fleetrl.models.reward_folder import is_sequence_classifier

        # tqdm's bar takes a multiprocessing lock that a rank's os._exit would leak
        hf_logging.disable_progress_bar()
        auto = (
            AutoModelForSequenceClassification
            if is_sequence_classifier(model_dir)
            else AutoModelForCausalLM
        )
        hf_model = auto.from_pretrained(model_dir, dtype=torch.float32)
        hf_model.eval()
        return cls(hf_model)

    def _tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named tensors as the trainer names them (tied lm_head left out, as in the checkpoint)."""
        return dict(self.hf_model.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each named tensor into the parameter of that HF name, with the rules of
        SGLang's Qwen2/Llama ``load_weights``: rotary caches are skipped, a name the model
        does not have is skipped with a warning (not an error), a shape mismatch raises."""
        params = self.named_weights()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue
            if name not in params:
                logger.warning("Parameter %s not found in params_dict", name)
                continue
            with torch.no_grad():
                default_weight_loader(params[name], tensor)

    def get_weights_by_name(
        self, name: str, truncate_size: int = 100, tp_size: int = 1
    ) -> list | None:
        """The first ``truncate_size`` rows as float32 lists (the shape SGLang's llama returns)."""
        params = self.named_weights()
        if name == "lm_head.weight" and self._tied():
            name = next(n for n in params if n.endswith("embed_tokens.weight"))
        if name not in params:
            return None
        return params[name].detach().cpu().to(torch.float32).numpy().tolist()[:truncate_size]

    @torch.no_grad()
    def next_token_logits(self, token_ids: list[int], lora_id: str | None = None) -> torch.Tensor:
        """Logits for the token after ``token_ids`` (no KV cache: recomputed each step), with
        LoRA adapter ``lora_id`` when given."""
        input_ids = torch.tensor([token_ids], dtype=torch.long)
        if lora_id is None and self.lora.peft_model is None:
            return self.hf_model(input_ids=input_ids).logits[0, -1].float()
        return self.lora.forward(input_ids, lora_id)[0, -1].float()

    @torch.no_grad()
    def last_token_head(self, token_ids: list[int]) -> list[float]:
        """A classifier's head at the last token's hidden state (SGLang's ``Pooler(LAST)``
        then the score head, as ``score_and_pool`` does), one value per label."""
        base = getattr(self.hf_model, self.hf_model.base_model_prefix)
        hidden = base(input_ids=torch.tensor([token_ids], dtype=torch.long)).last_hidden_state
        return self.hf_model.score(hidden[0, -1]).float().tolist()
