"""Score runner: a Hugging Face ``*ForSequenceClassification`` (a reward model) and its forwards.

``score(prompts)`` returns, per token list, the classification head at its last token: one
value per label (a reward model has one). That is SGLang's ``Pooler(LAST)`` over its
``Qwen2/LlamaForSequenceClassification`` and what transformers'
``AutoModelForSequenceClassification`` computes for an unpadded sequence. (For a padded
batch transformers reads the last token that is not ``pad_token_id``; a sequence that ends
with the pad token, e.g. an EOS that doubles as pad, is read at that token here and by
SGLang, one token earlier by transformers.)

Batching and the read-out are ``fleetrl.models.sequence_scores.score_at_last_tokens``, the
forward ``fleetrl rm eval`` runs too: sorted by length, forwards of at most ``max_rows``
rows and ``max_batch_tokens`` padded tokens, right-padded, the head at each row's last real
token (packing would need a varlen attention kernel this CPU path does not have).

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
from fleetrl.models.sequence_scores import length_chunks, score_at_last_tokens
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
        return length_chunks(
            lengths, max_rows=self.max_rows, max_batch_tokens=self.max_batch_tokens
        )

    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """The head's values at each prompt's last token, in the prompts' order."""
        self.forwards_run += len(self.forwards([len(p) for p in prompts]))
        return score_at_last_tokens(
            self.base, self.head, prompts, device=self.device,
            max_rows=self.max_rows, max_batch_tokens=self.max_batch_tokens,
        )  # fmt: skip

    # -- weights ---------------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict(keep_vars=True))

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy ``named_tensors`` into the model by name (all checked first); the count."""
        copy_weights(self.named_weights(), named_tensors, self.model_path, self.device)
        return len(named_tensors)
