"""Stream tokenized prompts from verl-schema Parquet files, epoch after epoch, resumably.

``PromptReader`` reads and validates every file once, renders each prompt with
the tokenizer's chat template (``add_generation_prompt=True``), tokenizes it,
and drops prompts longer than ``max_prompt_length`` tokens (counted in
``num_filtered``, logged once), or truncates them or refuses the file
(``truncation``, verl's values). ``max_samples`` keeps a subset of the rows (verl's
``train_max_samples``). It then hands out ``PromptItem``s forever:
epoch ``e`` visits every kept prompt once, in file order or in a permutation
drawn from ``numpy.random.default_rng([seed, e])`` — the same seed and epoch
always give the same order, independent of how many items were taken before.

The cursor is (epoch, position). ``state_dict()`` / ``load_state_dict()`` save
and restore it exactly: a reader restored from a state hands out the same next
prompt the saved one would have. Every item carries ``index`` = epoch * len +
position, its global cursor position; ``seek(index)`` moves the cursor there
(e.g. to the oldest prompt whose group was not yet trained on after a crash).

``iter_once()`` walks the kept prompts once in file order without touching the
cursor (validation sets).

Left out: files are held in memory (token ids in one int32 buffer); datasets of
millions of prompts would want lazy, sharded reading. Multimodal prompts are
not supported.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fleetrl.data.schema import DatasetError, read_rows
from fleetrl.log import get_logger

log = get_logger(__name__)

STATE_VERSION = 1


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One prompt, ready for an engine: token ids plus what the reward needs."""

    index: int  # global cursor position: epoch * len(reader) + position
    prompt_ids: np.ndarray  # int32, read-only view
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any]
    raw_prompt: list[dict[str, str]] | str  # the chat messages before templating, or plain text
    ability: str = ""
    file: str = ""  # which file and row it came from, for error messages and analysis
    row: int = -1


def render_prompt(
    tokenizer: ChatTokenizer, messages: list[dict[str, str]] | str, apply_chat_template: bool
) -> list[int]:
    """Token ids of ``messages``: chat template with generation prompt, or contents joined by
    newlines; a plain-string prompt is its own text."""
    if isinstance(messages, str):
        text = messages
    elif apply_chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(message["content"] for message in messages)
    return list(tokenizer.encode(text, add_special_tokens=False))


TRUNCATIONS = ("filter", "error", "left", "right", "middle")


def truncate(ids: list[int], limit: int, side: str) -> list[int]:
    """verl's truncation of an over-long prompt: left keeps the end, right the start, middle both."""
    if side == "left":
        return ids[-limit:]
    if side == "right":
        return ids[:limit]
    head = limit // 2
    return ids[:head] + ids[len(ids) - (limit - head) :]


def _sample(
    files: list[str], max_samples: int, shuffle: bool, seed: int
) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(file, row, row dict) of every row, or of ``max_samples`` of them (verl's
    ``train_max_samples``: a seeded random choice when shuffling, else the first ones)."""
    rows = [(file, i, row) for file in files for i, row in enumerate(read_rows(file))]
    if 0 < max_samples < len(rows):
        if shuffle:
            chosen = np.random.default_rng(seed).choice(len(rows), size=max_samples, replace=False)
            rows = [rows[i] for i in sorted(chosen.tolist())]
        else:
            rows = rows[:max_samples]
    yield from rows


class PromptReader:
    """Endless, deterministic, resumable stream of ``PromptItem``s (see the module docstring)."""

    def __init__(
        self,
        files: Sequence[str | Path],
        tokenizer: ChatTokenizer,
        *,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        shuffle: bool = True,
        seed: int = 1,
        truncation: str = "filter",
        max_samples: int = -1,
    ) -> None:
        if isinstance(files, (str, Path)):
            files = [files]
        if not files:
            raise DatasetError("<no files>", "no dataset files given")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        self.files = [str(f) for f in files]
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.seed = seed
        self.num_filtered = 0
        self.num_truncated = 0
        self._rows: list[dict[str, Any]] = []
        self._origin: list[tuple[str, int]] = []
        offsets = [0]
        chunks: list[np.ndarray] = []
        for file, row_index, row in _sample(self.files, max_samples, shuffle, seed):
            ids = render_prompt(tokenizer, row["prompt"], apply_chat_template)
            if len(ids) > max_prompt_length:
                if truncation == "filter":
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise DatasetError(
                        f"{file} row {row_index}",
                        f"prompt of {len(ids)} tokens is longer than data.max_prompt_length="
                        f"{max_prompt_length}; set data.truncation to filter, left, right or middle",
                    )
                ids = truncate(ids, max_prompt_length, truncation)
                self.num_truncated += 1
            chunks.append(np.asarray(ids, dtype=np.int32))
            offsets.append(offsets[-1] + len(ids))
            self._rows.append(row)
            self._origin.append((file, row_index))
        self._ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
        self._ids.flags.writeable = False
        self._offsets = np.asarray(offsets, dtype=np.int64)
        if self.num_filtered or self.num_truncated:
            log.warning(
                "%s %d of %d prompts longer than max_prompt_length=%d tokens (%s)",
                "filtered" if self.num_filtered else f"{truncation}-truncated",
                self.num_filtered or self.num_truncated,
                self.num_filtered + len(self._rows),
                max_prompt_length,
                ", ".join(self.files),
            )
        if not self._rows:
            raise DatasetError(
                ", ".join(self.files),
                f"no prompts left: all {self.num_filtered} are longer than "
                f"max_prompt_length={max_prompt_length} tokens",
            )
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        """Prompts kept after filtering (one epoch)."""
        return len(self._rows)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def cursor(self) -> int:
        """Global position of the next item (its ``index``)."""
        return self._epoch * len(self) + self._position

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self))

    def _item(self, row_id: int, index: int) -> PromptItem:
        row = self._rows[row_id]
        file, row_index = self._origin[row_id]
        return PromptItem(
            index=index,
            prompt_ids=self._ids[self._offsets[row_id] : self._offsets[row_id + 1]],
            data_source=row["data_source"],
            ground_truth=row["reward_model"]["ground_truth"],
            extra_info=dict(row["extra_info"]),
            raw_prompt=(
                row["prompt"]
                if isinstance(row["prompt"], str)
                else [dict(message) for message in row["prompt"]]
            ),
            ability=row["ability"],
            file=file,
            row=row_index,
        )

    def __iter__(self) -> Iterator[PromptItem]:
        return self

    def __next__(self) -> PromptItem:
        item = self._item(int(self._order[self._position]), self.cursor)
        self._position += 1
        if self._position == len(self):
            self._epoch += 1
            self._position = 0
            self._order = self._epoch_order(self._epoch)
        return item

    def take(self, count: int) -> list[PromptItem]:
        """The next ``count`` items."""
        return [next(self) for _ in range(count)]

    def seek(self, index: int) -> None:
        """Move the cursor so the next item has global position ``index``."""
        if index < 0:
            raise ValueError(f"cursor index must be >= 0, got {index}")
        epoch, position = divmod(index, len(self))
        if epoch != self._epoch:
            self._order = self._epoch_order(epoch)
        self._epoch, self._position = epoch, position

    def iter_once(self, max_samples: int = -1) -> Iterator[PromptItem]:
        """Every kept prompt once, in file order (at most ``max_samples`` unless -1); cursor untouched."""
        count = len(self) if max_samples < 0 else min(max_samples, len(self))
        for row_id in range(count):
            yield self._item(row_id, row_id)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "num_prompts": len(self),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by ``state_dict``; refuse a state from a different dataset setup."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"reader state version {state.get('version')!r} != {STATE_VERSION}")
        expected = {"num_prompts": len(self), "seed": self.seed, "shuffle": self.shuffle}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"reader state was saved with {key}={state.get(key)!r} but this reader has "
                    f"{key}={value!r} (files, tokenizer, max_prompt_length or data.seed changed?)"
                )
        position = int(state["position"])
        if not 0 <= position < len(self):
            raise ValueError(f"reader state position {position} outside [0, {len(self)})")
        self.seek(int(state["epoch"]) * len(self) + position)
