"""Score runner: a Hugging Face ``*ForSequenceClassification`` (a reward model) and its forwards.

``score(prompts)`` returns, per token list, the classification head at its last token: one
value per label (a reward model has one). That is SGLang's ``Pooler(LAST)`` over its
``Qwen2/LlamaForSequenceClassification`` and what transformers'
``AutoModelForSequenceClassification`` computes for an unpadded sequence. (For a padded
batch transformers reads the last token that is not ``pad_token_id``; a sequence that ends
with the pad token, e.g. an EOS that doubles as pad, is read at that token here and by
SGLang, one token earlier by transformers.)

Batching: padded, not packed. The prompts are sorted by length and cut into forwards of at
most ``max_rows`` rows and ``max_batch_tokens`` padded tokens (rows × longest row); each
forward right-pads with an attention mask, runs the base model once and applies the head to
the hidden state at each row's last real token. Right padding never changes the real
tokens' states under causal attention, and sorting keeps the padding small; packing would
need a varlen attention kernel this CPU path does not have.

Weights: ``load_weights`` copies tensors by Hugging Face name, everything validated before
the first copy (``runner.copy_weights``), for ``/update_weights_from_disk``. Driven by one
thread (``score_worker.ScoreWorker``), so nothing here locks. Left out: tensor parallelism,
multi-label outputs beyond returning every label.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fleetrl.log import get_logger
from fleetrl.models.loading import load_sequence_classifier, load_tokenizer
from rollout_fleet.engine.cli_args import DEFAULT_MAX_BATCH_TOKENS
from rollout_fleet.engine.runner import copy_weights

log = get_logger(__name__)

MAX_BATCH_TOKENS = DEFAULT_MAX_BATCH_TOKENS  # padded tokens (rows × longest row) in one forward
SCORE_HEAD = "score"  # transformers' name of the decoder classifiers' head (Qwen2, Llama, ...)


class ScoreRunner:
    """Forward passes and weight loads for one sequence classifier on one device."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_rows: int = 64,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
    ) -> None:
        if max_rows < 1 or max_batch_tokens < 1:
            raise ValueError(
                f"max_rows ({max_rows}) and max_batch_tokens ({max_batch_tokens}) must be >= 1"
            )
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer = load_tokenizer(model_path)
        model = load_sequence_classifier(model_path, dtype=dtype).to(self.device).eval()
        model.requires_grad_(False)
        self.model = model
        head = getattr(model, SCORE_HEAD, None)
        base = getattr(model, model.base_model_prefix, None)
        if not isinstance(head, torch.nn.Module) or not isinstance(base, torch.nn.Module):
            raise ValueError(
                f"{self.model_path}: {type(model).__name__} has no `{SCORE_HEAD}` head over a"
                f" `{model.base_model_prefix}` decoder; the embedded engine scores decoder"
                " classifiers (Qwen2/Llama/...ForSequenceClassification)"
            )
        self.head, self.base = head, base
        self.forwards_run = 0
        config = model.config
        self.architectures = list(getattr(config, "architectures", None) or [type(model).__name__])
        self.model_type = str(getattr(config, "model_type", ""))
        self.num_labels = int(config.num_labels)
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        log.info(
            "loaded reward model %s on %s (%s): %d label(s), vocab %d, max context %d",
            self.model_path,
            self.device,
            dtype,
            self.num_labels,
            self.vocab_size,
            self.max_context,
        )

    def forwards(self, lengths: list[int]) -> list[list[int]]:
        """The indices of each forward ``score`` runs for prompts of ``lengths``."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        chunks: list[list[int]] = []
        current: list[int] = []
        for index in order:
            rows = len(current) + 1
            if current and (rows > self.max_rows or rows * lengths[index] > self.max_batch_tokens):
                chunks.append(current)
                current = []
            current.append(index)
        if current:
            chunks.append(current)
        return chunks

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """The head's values at each prompt's last token, in the prompts' order."""
        out: list[list[float]] = [[] for _ in prompts]
        for chunk in self.forwards([len(p) for p in prompts]):
            values = self._forward([prompts[i] for i in chunk])
            for index, row in zip(chunk, values, strict=True):
                out[index] = row
        return out

    def _forward(self, rows: list[list[int]]) -> list[list[float]]:
        longest = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.forwards_run += 1
        padded = bool((mask == 0).any())
        hidden = self.base(input_ids=ids, attention_mask=mask if padded else None)
        states = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
        last = mask.sum(dim=1) - 1
        pooled = states[torch.arange(len(rows), device=self.device), last]
        return self.head(pooled).float().cpu().tolist()

    # -- weights ---------------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict(keep_vars=True))

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy ``named_tensors`` into the model by name (all checked first); the count."""
        copy_weights(self.named_weights(), named_tensors, self.model_path, self.device)
        return len(named_tensors)
