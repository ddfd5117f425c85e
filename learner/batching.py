"""From an Arrow batch to per-rank micro-batches: the learner's batch plan.

Every rank holds the whole global batch (rank 0 broadcasts its Arrow IPC bytes),
so every rank computes the *same* plan locally, with no extra collective:

1. ``GlobalBatch.from_arrow`` reads the token columns as flat numpy arrays plus
   offsets (``buffer.arrow_batch.list_column_numpy``, zero-copy), never one
   Python object per token.
2. ``mini_batches`` cuts the batch into optimizer steps by prompt group
   (``ppo_mini_batch_size`` groups each, in batch order; a group is never split).
3. ``plan_ranks`` splits one mini-batch across ranks balanced by token count
   (longest-first greedy onto the least-loaded rank; ties go to the lower rank
   and lower index, so the plan is deterministic), cuts each rank's share into
   micro-batches under a token budget (or a fixed count), and pads every rank to
   the same number of micro-batches with empty ones, so FSDP's per-micro-batch
   collectives line up.

Loss normalisation: the global token and sequence counts of a mini-batch are
read off the global batch (identical on every rank, so equal to an all-reduce
of the per-rank counts), which makes token-mean exact under any split. They
count *trained* tokens: ``loss_mask`` (multi-turn responses) is 0 on a tool's or
environment's reply, which the model reads as context but is not trained on;
``response_mask`` is within-length AND the loss mask, the mask of every loss.
Costs (rank balance, micro-batch budgets) count every token: the forward pass
computes them all.

Failed rewards: a sample whose reward failed on the rollout side (the Arrow column
``reward_error`` non-empty), or whose score is not finite, is no outcome of its
prompt. ``GlobalBatch.reward_valid`` is False for it, its loss mask is all 0 (so
every loss, count and per-token metric skips it, as it skips a tool reply) and its
score reads 0.0, whatever the wire carried; group statistics take the valid
samples only (``learner.algorithms``).

Left out: shuffling mini-batches between epochs (verl's actor default is no
shuffle), and splitting one sequence across micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from buffer.arrow_batch import (
    REQUIRED_COLUMNS,
    list_column_numpy,
    loss_mask_column,
    reward_error_column,
)
from buffer.wire import WireError


class BatchError(ValueError):
    """A batch the learner cannot train on (missing columns, inconsistent lengths)."""


@dataclass(frozen=True)
class GlobalBatch:
    """The global batch as flat token arrays plus per-sequence offsets."""

    prompt_values: np.ndarray  # int32, all prompts concatenated
    prompt_offsets: np.ndarray  # [B+1]
    response_values: np.ndarray  # int32
    response_offsets: np.ndarray  # [B+1]
    behavior_logprobs: np.ndarray  # float32, aligned with response_values
    token_versions: np.ndarray  # int32, aligned with response_values
    # uint8, aligned with response_values: 1 trained, 0 a tool/env token or a failed sample's
    loss_mask: np.ndarray
    scores: np.ndarray  # float32 [B], 0.0 where the reward failed
    group_index: np.ndarray  # int64 [B], groups numbered by first appearance
    temperature: np.ndarray  # float32 [B]
    truncated: np.ndarray  # bool [B], finish_reason == "length"
    # bool [B]: the reward was scored (False: it failed; the sample trains nothing). A
    # default keeps batches built directly (tests, benchmarks) as they were: every one valid.
    reward_valid: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.reward_valid is None:
            object.__setattr__(self, "reward_valid", np.ones(len(self.scores), dtype=bool))

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> GlobalBatch:
        missing = [name for name in REQUIRED_COLUMNS if name not in batch.schema.names]
        if missing:
            raise BatchError(f"learner batch lacks columns {missing} of buffer.arrow_batch.SCHEMA")
        if batch.num_rows == 0:
            raise BatchError("learner batch is empty")
        prompts, prompt_offsets = list_column_numpy(batch, "prompt_ids")
        responses, response_offsets = list_column_numpy(batch, "response_ids")
        behavior, behavior_offsets = list_column_numpy(batch, "behavior_logprobs")
        versions, version_offsets = list_column_numpy(batch, "token_versions")
        if not (
            np.array_equal(response_offsets, behavior_offsets)
            and np.array_equal(response_offsets, version_offsets)
        ):
            raise BatchError(
                "learner batch: response_ids, behavior_logprobs and token_versions "
                "have different per-row lengths"
            )
        try:
            loss_mask = loss_mask_column(batch)
        except WireError as err:
            raise BatchError(f"learner batch: {err}") from None
        if np.any(np.diff(prompt_offsets) == 0):
            row = int(np.argmax(np.diff(prompt_offsets) == 0))
            raise BatchError(f"learner batch row {row} has an empty prompt")
        temperature = batch.column("temperature").to_numpy(zero_copy_only=False)
        if np.any(~(temperature > 0)):
            row = int(np.argmax(~(temperature > 0)))
            raise BatchError(f"learner batch row {row}: temperature {temperature[row]} must be > 0")
        group_ids = batch.column("group_id").to_pylist()
        numbering: dict[str, int] = {}
        group_index = np.array(
            [numbering.setdefault(g, len(numbering)) for g in group_ids], dtype=np.int64
        )
        reasons = batch.column("finish_reason").to_pylist()
        scores = batch.column("score").to_numpy(zero_copy_only=False).astype(np.float32)
        valid = np.isfinite(scores) & np.array(
            [not error for error in reward_error_column(batch)], dtype=bool
        )
        if not valid.all():  # a failed reward: nothing of the sample is trained on
            token_valid = np.repeat(valid, np.diff(response_offsets)).astype(np.uint8)
            loss_mask = loss_mask * token_valid
            scores = np.where(valid, scores, np.float32(0.0))
        return cls(
            prompt_values=prompts.astype(np.int64, copy=False),
            prompt_offsets=prompt_offsets.astype(np.int64),
            response_values=responses.astype(np.int64, copy=False),
            response_offsets=response_offsets.astype(np.int64),
            behavior_logprobs=behavior.astype(np.float32, copy=False),
            token_versions=versions.astype(np.int64, copy=False),
            loss_mask=loss_mask,
            scores=scores,
            group_index=group_index,
            temperature=temperature.astype(np.float32),
            truncated=np.array([r == "length" for r in reasons], dtype=bool),
            reward_valid=valid,
        )

    @property
    def size(self) -> int:
        return len(self.scores)

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.diff(self.prompt_offsets)

    @property
    def response_lens(self) -> np.ndarray:
        return np.diff(self.response_offsets)

    @property
    def trained_lens(self) -> np.ndarray:
        """Per sequence, its response tokens with loss mask 1."""
        cumulative = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        return cumulative[self.response_offsets[1:]] - cumulative[self.response_offsets[:-1]]

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prompt_lens + self.response_lens

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_values[self.prompt_offsets[i] : self.prompt_offsets[i + 1]]

    def response(self, i: int) -> np.ndarray:
        return self.response_values[self.response_offsets[i] : self.response_offsets[i + 1]]


def padded(flat: np.ndarray, offsets: np.ndarray, width: int | None = None) -> np.ndarray:
    """Right-pad ragged rows (flat values + offsets) into ``[B, width]`` with zeros."""
    lens = np.diff(offsets)
    width = int(lens.max(initial=0)) if width is None else width
    out = np.zeros((len(lens), max(width, 1)), dtype=flat.dtype)
    cols = np.arange(out.shape[1])
    mask = cols[None, :] < lens[:, None]
    out[mask] = flat[offsets[0] : offsets[-1]]
    return out


def response_mask(batch: GlobalBatch) -> np.ndarray:
    """``[B, T]`` float32: 1 where a response token exists AND is trained (loss mask 1)."""
    return padded(batch.loss_mask, batch.response_offsets).astype(np.float32)


def mini_batches(group_index: np.ndarray, groups_per_mini_batch: int) -> list[np.ndarray]:
    """Sequence indices of each mini-batch: whole groups, in batch order (0 = one mini-batch)."""
    n_groups = int(group_index.max()) + 1 if len(group_index) else 0
    if groups_per_mini_batch <= 0 or groups_per_mini_batch >= n_groups:
        return [np.arange(len(group_index))]
    out = []
    for start in range(0, n_groups, groups_per_mini_batch):
        chosen = (group_index >= start) & (group_index < start + groups_per_mini_batch)
        out.append(np.flatnonzero(chosen))
    return out


def balance_across_ranks(
    indices: np.ndarray, costs: np.ndarray, world_size: int
) -> list[np.ndarray]:
    """Split ``indices`` into ``world_size`` sets with near-equal total ``costs[i]``.

    Longest-processing-time greedy: largest first onto the least-loaded rank.
    Each returned set is sorted ascending (batch order).
    """
    order = indices[np.lexsort((indices, -costs[indices]))]
    loads = np.zeros(world_size, dtype=np.int64)
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        rank = int(np.argmin(loads))  # argmin returns the first (lowest) rank on ties
        assigned[rank].append(int(i))
        loads[rank] += int(costs[i])
    return [np.array(sorted(a), dtype=np.int64) for a in assigned]


def micro_batches(
    indices: np.ndarray,
    seq_lens: np.ndarray,
    *,
    use_dynamic_bsz: bool,
    max_tokens: int,
    micro_batch_size: int,
    packing: bool,
) -> list[np.ndarray]:
    """Cut one rank's sequences into micro-batches.

    Dynamic: longest first, filling each micro-batch while its cost stays within
    ``max_tokens`` (cost = Σ lengths when packed, count × longest when padded);
    a sequence longer than the budget gets a micro-batch of its own. Fixed:
    ``micro_batch_size`` sequences each, in batch order.
    """
    if len(indices) == 0:
        return []
    if not use_dynamic_bsz:
        return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    order = indices[np.lexsort((indices, -seq_lens[indices]))]
    batches: list[list[int]] = []
    current: list[int] = []
    current_sum = 0
    current_max = 0
    for i in order:
        length = int(seq_lens[i])
        new_sum, new_max = current_sum + length, max(current_max, length)
        cost = new_sum if packing else new_max * (len(current) + 1)
        if current and cost > max_tokens:
            batches.append(current)
            current, new_sum, new_max = [], length, length
        current.append(int(i))
        current_sum, current_max = new_sum, new_max
    if current:
        batches.append(current)
    return [np.array(b, dtype=np.int64) for b in batches]


def plan_ranks(
    indices: np.ndarray,
    seq_lens: np.ndarray,
    world_size: int,
    *,
    use_dynamic_bsz: bool,
    max_tokens: int,
    micro_batch_size: int,
    packing: bool,
) -> list[list[np.ndarray]]:
    """Per rank, its micro-batches (index arrays); all ranks get the same count (empty = padding)."""
    shares = balance_across_ranks(indices, seq_lens, world_size)
    plans = [
        micro_batches(
            share,
            seq_lens,
            use_dynamic_bsz=use_dynamic_bsz,
            max_tokens=max_tokens,
            micro_batch_size=micro_batch_size,
            packing=packing,
        )
        for share in shares
    ]
    depth = max(1, max(len(p) for p in plans))
    empty = np.zeros(0, dtype=np.int64)
    return [p + [empty] * (depth - len(p)) for p in plans]


def global_counts(batch: GlobalBatch, indices: np.ndarray) -> tuple[int, int]:
    """(trained tokens, sequences with ≥1 trained token) of a mini-batch, over all ranks."""
    lens = batch.trained_lens[indices]
    return int(lens.sum()), int((lens > 0).sum())
