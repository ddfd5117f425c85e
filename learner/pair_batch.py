"""Preference pairs on the learner: the batch, its plan over ranks, and one scoring forward.

A batch is the Arrow record batch ``fleetrl.data.pairs.PAIR_SCHEMA`` (chosen and
rejected token ids, margin), broadcast to every rank as IPC bytes like the RL batch, so
every rank computes the same plan locally:

- the unit of work is a *pair*: ``plan_pairs`` balances pairs over the data-parallel
  ranks and cuts each rank's share into micro-batches with the learner's own
  ``learner.batching.plan_ranks`` (token budget or fixed count, every rank padded to the
  same number of micro-batches), a pair's cost being what its two sequences cost
  together (packed: their lengths summed; padded: two rows of the longer one);
- ``build_pair_inputs`` lays out both sequences of every pair of a micro-batch in the same
  rows (``learner.packing.layout_sequences``: packed with restarting positions, or
  padded), chosen ones first, so chosen and rejected go through ONE forward, and marks
  the last token of each sequence (its EOS) as the one position read;
- the forward is the critic's ``learner.packing.value_forward``: the one-label head at
  those positions, the reward model's score for each sequence.

The inputs are a ``learner.packing.MicroBatchInputs`` whose "tokens" are the 2n read-out
positions (chosen scores then rejected scores), so the same forward serves both models.

Left out: sequence parallelism (``learner.sequence_parallel`` must be 1 for reward-model
training), several responses per prompt (listwise losses).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from buffer.arrow_batch import list_column_numpy
from fleetrl.data.pairs import PAIR_SCHEMA
from fleetrl.models.sequence_scores import last_token_columns
from learner.batching import BatchError, plan_ranks
from learner.packing import MicroBatchInputs, as_long, layout_sequences


@dataclass(frozen=True)
class PairBatch:
    """A batch of preference pairs as flat token arrays plus per-sequence offsets."""

    chosen_values: np.ndarray
    chosen_offsets: np.ndarray  # [B+1]
    rejected_values: np.ndarray
    rejected_offsets: np.ndarray  # [B+1]
    margin: np.ndarray  # float32 [B]

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> PairBatch:
        missing = [name for name in PAIR_SCHEMA.names if name not in batch.schema.names]
        if missing:
            raise BatchError(f"pair batch lacks columns {missing} of fleetrl.data.pairs.PAIR_SCHEMA")  # fmt: skip
        if batch.num_rows == 0:
            raise BatchError("pair batch is empty")
        chosen, chosen_offsets = list_column_numpy(batch, "chosen_ids")
        rejected, rejected_offsets = list_column_numpy(batch, "rejected_ids")
        for name, offsets in (("chosen_ids", chosen_offsets), ("rejected_ids", rejected_offsets)):
            if np.any(np.diff(offsets) == 0):
                row = int(np.argmax(np.diff(offsets) == 0))
                raise BatchError(f"pair batch row {row}: empty {name}")
        margin = batch.column("margin").to_numpy(zero_copy_only=False).astype(np.float32)
        return cls(
            chosen.astype(np.int64, copy=False), chosen_offsets.astype(np.int64),
            rejected.astype(np.int64, copy=False), rejected_offsets.astype(np.int64), margin,
        )  # fmt: skip

    @property
    def size(self) -> int:
        return len(self.margin)

    @property
    def chosen_lens(self) -> np.ndarray:
        return np.diff(self.chosen_offsets)

    @property
    def rejected_lens(self) -> np.ndarray:
        return np.diff(self.rejected_offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.chosen_lens.sum() + self.rejected_lens.sum())

    def chosen(self, i: int) -> np.ndarray:
        return self.chosen_values[self.chosen_offsets[i] : self.chosen_offsets[i + 1]]

    def rejected(self, i: int) -> np.ndarray:
        return self.rejected_values[self.rejected_offsets[i] : self.rejected_offsets[i + 1]]

    def pair_costs(self, packing: bool) -> np.ndarray:
        """What one pair costs a micro-batch: its tokens packed, two rows of the longer padded."""
        if packing:
            return self.chosen_lens + self.rejected_lens
        return 2 * np.maximum(self.chosen_lens, self.rejected_lens)


def plan_pairs(
    batch: PairBatch,
    indices: np.ndarray,
    dp_size: int,
    dp_rank: int,
    *,
    use_dynamic_bsz: bool,
    max_tokens: int,
    micro_batch_size: int,
    packing: bool,
) -> list[np.ndarray]:
    """This rank's micro-batches of pair indices (``micro_batch_size`` counts pairs)."""
    plans = plan_ranks(
        indices, batch.pair_costs(packing), dp_size, use_dynamic_bsz=use_dynamic_bsz,
        max_tokens=max_tokens, micro_batch_size=micro_batch_size, packing=packing,
    )  # fmt: skip
    return plans[dp_rank]


def build_pair_inputs(
    batch: PairBatch,
    indices: np.ndarray,
    *,
    packing: bool,
    device: torch.device,
    row_tokens: int | None = None,
) -> MicroBatchInputs:
    """Inputs that score both sequences of the pairs ``indices`` in one forward.

    The read-out positions (``rows``, ``cols``) are the last token of each chosen
    sequence, in ``indices`` order, then of each rejected one. An empty set yields the
    one-token dummy row every rank still runs (FSDP's collectives must line up).
    """
    n = len(indices)
    if n == 0:
        return MicroBatchInputs.empty(device)
    seqs = [batch.chosen(i) for i in indices] + [batch.rejected(i) for i in indices]
    layout = layout_sequences(seqs, packing=packing, row_tokens=row_tokens)
    last = last_token_columns(layout.start_of, np.array([len(s) for s in seqs]))
    return MicroBatchInputs(
        indices=indices,
        input_ids=as_long(layout.ids, device),
        position_ids=as_long(layout.positions, device),
        attention_mask=None if layout.mask is None else as_long(layout.mask, device),
        rows=as_long(layout.row_of, device),
        cols=as_long(last, device),
        # one read-out "token" per sequence: its last token's id (value_forward reads
        # only rows and cols; the count sizes the outputs)
        labels=as_long(np.array([s[-1] for s in seqs]), device),
        temperature=torch.ones(2 * n, device=device),
        response_offsets=np.arange(2 * n + 1, dtype=np.int64),
    )


def split_scores(scores: torch.Tensor, inputs: MicroBatchInputs) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(chosen [n], rejected [n]) from the 2n scores of ``value_forward`` over ``inputs``."""
    n = len(inputs.indices)
    return scores[:n], scores[n:]
