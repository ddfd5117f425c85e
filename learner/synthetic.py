"""Synthetic learner batches: random token sequences in the buffer's Arrow schema.

For tests and ``bench/learner.py``: builds ``buffer.wire.Trajectory`` objects
(the real wire type, so the batch is exactly what the buffer hands out) and
packs them with ``buffer.arrow_batch.trajectories_to_arrow``. Lengths can be
given explicitly or drawn from a long-tailed (lognormal) distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from buffer.arrow_batch import trajectories_to_arrow
from buffer.wire import Array, Trajectory


def lognormal_lengths(
    n: int, *, median: float, sigma: float, low: int, high: int, seed: int
) -> np.ndarray:
    """``n`` integer lengths, lognormal around ``median``, clipped to [low, high]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.round(draws), low, high).astype(np.int64)


def synthetic_batch(
    *,
    vocab_size: int,
    groups: int,
    group_size: int,
    prompt_lens: Sequence[int] | int,
    response_lens: Sequence[int],
    seed: int = 0,
    token_versions: Sequence[int] | int = 0,
    temperature: float = 1.0,
    first_token_id: int = 6,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> pa.RecordBatch:
    """A batch of ``groups × group_size`` random trajectories with random scores in {0, 1}.

    ``prompt_lens`` is per group (or one value); ``response_lens`` per sample;
    ``token_versions`` per sample (or one value). Token ids avoid the first
    ``first_token_id`` ids (special tokens of the tiny tokenizer). ``loss_masks``
    per sample (None: every token trained) marks tool/environment tokens with 0;
    those get behaviour logprob 0.0, as a multi-turn rollout sends them.
    """
    n = groups * group_size
    if len(response_lens) != n:
        raise ValueError(f"synthetic_batch: need {n} response lengths, got {len(response_lens)}")
    rng = np.random.default_rng(seed)
    prompt_lens = [prompt_lens] * groups if isinstance(prompt_lens, int) else list(prompt_lens)
    versions = [token_versions] * n if isinstance(token_versions, int) else list(token_versions)
    masks = list(loss_masks) if loss_masks is not None else [None] * n
    if len(masks) != n:
        raise ValueError(f"synthetic_batch: need {n} loss masks, got {len(masks)}")
    trajectories = []
    for g in range(groups):
        prompt = rng.integers(first_token_id, vocab_size, size=prompt_lens[g])
        for k in range(group_size):
            i = g * group_size + k
            length = int(response_lens[i])
            response = rng.integers(first_token_id, vocab_size, size=length)
            behavior = -rng.uniform(0.5, 6.0, size=length)
            mask = masks[i]
            if mask is not None:
                behavior = np.where(np.asarray(mask) == 0, 0.0, behavior)
            trajectories.append(
                Trajectory(
                    uid=f"g{g}/{k}",
                    group_id=f"g{g}",
                    group_size=group_size,
                    prompt_ids=Array.of(prompt, "int32"),
                    response_ids=Array.of(response, "int32"),
                    behavior_logprobs=Array.of(behavior, "float32"),
                    token_versions=Array.of(np.full(length, versions[i]), "int32"),
                    score=float(rng.integers(0, 2)),
                    finish_reason="length" if k == 0 else "stop",
                    prompt_index=g,
                    temperature=temperature,
                    loss_mask=None if mask is None else Array.of(mask, "uint8"),
                )
            )
    return trajectories_to_arrow(trajectories)
