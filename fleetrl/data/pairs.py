"""Tokenized preference pairs, the epochs over them, and the Arrow batches the learner reads.

``PreferencePairs`` reads and validates every preference file once
(``fleetrl.data.preference``), renders both sequences of each pair as the reward model
reads them (``fleetrl.data.render.render_reward_input``: prompt + response, EOS last) and keeps the
token ids in two flat int32 buffers. Rows that cannot teach anything are counted by
reason and dropped, logged once, as the RL prompt reader drops over-long prompts:

- ``empty``: an empty (or whitespace-only) prompt, chosen or rejected text;
- ``same_response``: chosen == rejected (no preference to learn; the loss is constant);
- ``over_length``: either sequence longer than ``max_length`` tokens.

A file left with no pair is an error naming the files and the counts.

``PairCursor`` hands out pair indices epoch after epoch, each epoch in file order or in a
permutation drawn from ``numpy.random.default_rng([seed, epoch])``; its state (epoch,
position) goes into checkpoints, so a resumed run trains on the very pairs the
uninterrupted one would have.

``PreferencePairs.to_arrow(indices)`` is the batch format of the reward-model learner
(``PAIR_SCHEMA``: ``list<int32>`` token columns, read back as numpy views by
``learner.pair_batch``): rank 0 builds it, the learner group broadcasts its IPC bytes.

Left out: the files are held in memory (fine for HH-RLHF's 160k pairs: ~400 MB of token
ids at 300 tokens each); listwise (more than two responses) data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from fleetrl.data.preference import read_preference_rows
from fleetrl.data.render import render_reward_input
from fleetrl.data.schema import DatasetError
from fleetrl.log import get_logger

log = get_logger(__name__)

PAIR_SCHEMA = pa.schema(
    [
        ("chosen_ids", pa.list_(pa.int32())),
        ("rejected_ids", pa.list_(pa.int32())),
        ("margin", pa.float32()),
        ("pair_index", pa.int64()),  # the pair's place in its PreferencePairs (for analysis)
    ]
)
DROP_REASONS = ("empty", "same_response", "over_length")
CURSOR_STATE_VERSION = 1


def _is_empty(prompt: Any, chosen: str, rejected: str) -> bool:
    if isinstance(prompt, str):
        prompt_empty = not prompt.strip()
    else:
        prompt_empty = not any(m["content"].strip() for m in prompt)
    return prompt_empty or not chosen.strip() or not rejected.strip()


def _ragged(chunks: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chunks], out=offsets[1:])
    flat = np.fromiter((t for c in chunks for t in c), dtype=np.int32, count=int(offsets[-1]))
    flat.flags.writeable = False
    return flat, offsets


class PreferencePairs:
    """Every kept pair of some preference files, tokenized, in file order."""

    def __init__(
        self,
        files: Sequence[str | Path],
        tokenizer: Any,
        *,
        max_length: int,
        apply_chat_template: bool = True,
    ) -> None:
        if isinstance(files, str | Path):
            files = [files]
        if not files:
            raise DatasetError("<no files>", "no preference files given")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 tokens, got {max_length}")
        self.files = [str(f) for f in files]
        self.max_length = max_length
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.origin: list[tuple[str, int]] = []  # (file, row) of each kept pair
        # on: the template where the tokenizer has one (reward.model.apply_chat_template's auto)
        template = "auto" if apply_chat_template else "off"
        chosen: list[list[int]] = []
        rejected: list[list[int]] = []
        margins: list[float] = []
        for file in self.files:
            for row_index, row in enumerate(read_preference_rows(file)):
                reason = self._drop_reason(row)
                if reason is None:
                    ids = [
                        render_reward_input(tokenizer, row["prompt"], row[side], template)
                        for side in ("chosen", "rejected")
                    ]
                    if max(len(ids[0]), len(ids[1])) > max_length:
                        reason = "over_length"
                if reason is not None:
                    self.dropped[reason] += 1
                    continue
                chosen.append(ids[0])
                rejected.append(ids[1])
                margins.append(row["margin"])
                self.origin.append((file, row_index))
        self._chosen, self._chosen_offsets = _ragged(chosen)
        self._rejected, self._rejected_offsets = _ragged(rejected)
        self.margin = np.asarray(margins, dtype=np.float32)
        if any(self.dropped.values()):
            log.warning("%s (%s)", self.summary(), ", ".join(self.files))
        if not self.origin:
            raise DatasetError(", ".join(self.files), f"no preference pairs left: {self.summary()}")

    @staticmethod
    def _drop_reason(row: dict[str, Any]) -> str | None:
        if _is_empty(row["prompt"], row["chosen"], row["rejected"]):
            return "empty"
        if row["chosen"] == row["rejected"]:
            return "same_response"
        return None

    def __len__(self) -> int:
        return len(self.origin)

    @property
    def num_rows(self) -> int:
        """Rows read, kept or dropped."""
        return len(self) + sum(self.dropped.values())

    def summary(self) -> str:
        drops = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items() if n)
        text = f"kept {len(self)} of {self.num_rows} preference pairs"
        if drops:
            text += f"; dropped {drops} (over_length: longer than max_length={self.max_length} tokens)"  # fmt: skip
        return text

    def chosen(self, i: int) -> np.ndarray:
        return self._chosen[self._chosen_offsets[i] : self._chosen_offsets[i + 1]]

    def rejected(self, i: int) -> np.ndarray:
        return self._rejected[self._rejected_offsets[i] : self._rejected_offsets[i + 1]]

    @property
    def num_tokens(self) -> int:
        return int(self._chosen_offsets[-1] + self._rejected_offsets[-1])

    def to_arrow(self, indices: Sequence[int] | np.ndarray) -> pa.RecordBatch:
        """The pairs ``indices`` as one record batch with ``PAIR_SCHEMA`` (order kept)."""
        indices = np.asarray(indices, dtype=np.int64)

        def column(flat: np.ndarray, offsets: np.ndarray) -> pa.ListArray:
            starts, ends = offsets[indices], offsets[indices + 1]
            out_offsets = np.zeros(len(indices) + 1, dtype=np.int32)
            np.cumsum(ends - starts, out=out_offsets[1:])
            values = (
                np.concatenate([flat[s:e] for s, e in zip(starts, ends, strict=True)])
                if len(indices)
                else np.zeros(0, np.int32)
            )
            return pa.ListArray.from_arrays(pa.array(out_offsets), pa.array(values, pa.int32()))

        return pa.RecordBatch.from_arrays(
            [
                column(self._chosen, self._chosen_offsets),
                column(self._rejected, self._rejected_offsets),
                pa.array(self.margin[indices], pa.float32()),
                pa.array(indices, pa.int64()),
            ],
            schema=PAIR_SCHEMA,
        )


class PairCursor:
    """Pair indices epoch after epoch, deterministic in (seed, epoch), resumable."""

    def __init__(self, num_pairs: int, *, shuffle: bool, seed: int) -> None:
        if num_pairs < 1:
            raise ValueError(f"a pair cursor needs at least one pair, got {num_pairs}")
        self.num_pairs, self.shuffle, self.seed = num_pairs, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_pairs)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_pairs)

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` pair indices (crossing into the next epoch when one ends)."""
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            out[k] = self._order[self.position]
            self.position += 1
            if self.position == self.num_pairs:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": CURSOR_STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "num_pairs": self.num_pairs,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by ``state_dict``; refuse one saved over other data."""
        if state.get("version") != CURSOR_STATE_VERSION:
            raise ValueError(f"pair cursor state version {state.get('version')!r} != {CURSOR_STATE_VERSION}")  # fmt: skip
        for key in ("num_pairs", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"pair cursor state was saved with {key}={state.get(key)!r} but the data "
                    f"now has {key}={getattr(self, key)!r} (files, tokenizer, data.max_length "
                    "or data.seed changed?)"
                )
        position = int(state["position"])
        if not 0 <= position < self.num_pairs:
            raise ValueError(f"pair cursor position {position} outside [0, {self.num_pairs})")
        self.epoch, self.position = int(state["epoch"]), position
        self._order = self._epoch_order(self.epoch)
