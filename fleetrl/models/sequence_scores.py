"""A sequence's score: a classifier head read at the sequence's last token.

A reward model (a one-label ``*ForSequenceClassification``) scores a sequence with its
head at the sequence's last token, its EOS (``fleetrl.data.render``): SGLang's
``Pooler(LAST)``, the embedded reward engine, ``fleetrl rm eval`` and the reward-model
learner all read it there, so ``last_token_columns`` says where that is in a row of
sequences laid side by side, and ``score_at_last_tokens`` is the forward every
inference path runs. (transformers' own pooling reads the last token that is not
``pad_token_id``: a sequence ending with an EOS that doubles as the pad token would be
read one token early, so nobody here uses it.)

Batching: padded, not packed. The sequences are sorted by length and cut into forwards
of at most ``max_rows`` rows and ``max_batch_tokens`` padded tokens (rows × longest row);
each forward right-pads with an attention mask, runs the backbone once and applies the
head to the hidden state at each row's last real token. Right padding never changes the
real tokens' states under causal attention, and sorting keeps the padding small.
(The learner packs its pairs instead, ``learner.pair_batch``, reading the same columns.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

DEFAULT_MAX_ROWS = 64


def last_token_columns(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The column of each sequence's last token, for sequences starting at ``starts``."""
    return np.asarray(starts, dtype=np.int64) + np.asarray(lengths, dtype=np.int64) - 1


def length_chunks(lengths: Sequence[int], *, max_rows: int, max_batch_tokens: int) -> list[list[int]]:  # fmt: skip
    """The sequence indices of each forward: by length, at most ``max_rows`` rows and
    ``max_batch_tokens`` padded tokens (a longer sequence gets a forward of its own)."""
    if max_rows < 1 or max_batch_tokens < 1:
        raise ValueError(f"max_rows ({max_rows}) and max_batch_tokens ({max_batch_tokens}) must be >= 1")  # fmt: skip
    chunks: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        rows = len(current) + 1
        if current and (rows > max_rows or rows * lengths[index] > max_batch_tokens):
            chunks.append(current)
            current = []
        current.append(index)
    if current:
        chunks.append(current)
    return chunks


def _forward(backbone: nn.Module, head: nn.Module, rows: list[Sequence[int]], device: torch.device) -> list[list[float]]:  # fmt: skip
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    ids = nn.utils.rnn.pad_sequence(
        [torch.as_tensor(np.asarray(r, dtype=np.int64)) for r in rows], batch_first=True
    )
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    padded = bool((lengths < ids.shape[1]).any())
    hidden = backbone(input_ids=ids.to(device), attention_mask=mask.to(device) if padded else None)
    states = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    last = torch.from_numpy(last_token_columns(np.zeros(len(rows)), lengths.numpy()))
    pooled = states[torch.arange(len(rows), device=device), last.to(device)]
    return head(pooled).float().cpu().tolist()


@torch.inference_mode()
def score_at_last_tokens(
    backbone: nn.Module,
    head: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    device: torch.device | str = "cpu",
    max_rows: int = DEFAULT_MAX_ROWS,
    max_batch_tokens: int = 1 << 16,
) -> list[list[float]]:
    """The head's values (one per label) at each sequence's last token, in input order."""
    device = torch.device(device)
    out: list[list[float]] = [[] for _ in sequences]
    chunks = length_chunks(
        [len(s) for s in sequences], max_rows=max_rows, max_batch_tokens=max_batch_tokens
    )
    for chunk in chunks:
        values = _forward(backbone, head, [sequences[i] for i in chunk], device)
        for index, row in zip(chunk, values, strict=True):
            out[index] = row
    return out
