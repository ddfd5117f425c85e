"""Data section of the run config: prompt files, batch size, filtering, shuffling, and the
synthetic task generated when the files are missing (CPU demo). Task names must match
``fleetrl.data.synth.TASKS`` (a unit test checks this)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class DataConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    train_files: Annotated[
        list[str] | str,
        Meta(
            description="Parquet files of training prompts (verl's schema, docs/data.md; checked before the run starts): a list, or one path as a string (as verl accepts); a leading ~ is expanded."
        ),
    ] = []
    val_files: Annotated[
        list[str] | str,
        Meta(
            description="Parquet files of validation prompts: a list or one path, ~ expanded (empty = no validation)."
        ),
    ] = []
    train_batch_size: Annotated[
        int,
        Meta(
            ge=1,
            description="Prompts (GRPO groups) per learner step; each brings rollout.n samples.",
        ),
    ] = 8
    max_prompt_length: Annotated[
        int,
        Meta(
            ge=1,
            description="Longest prompt in tokens, after the chat template; a longer one is handled as truncation says.",
        ),
    ] = 512
    truncation: Annotated[
        Literal["filter", "error", "left", "right", "middle"],
        Meta(
            description="A prompt longer than max_prompt_length: filter = dropped and counted (one log line); error = the run refuses to start, naming its file and row (verl's data.truncation default); left = keep its last max_prompt_length tokens; right = its first; middle = its first and last halves (verl's values)."
        ),
    ] = "filter"
    train_max_samples: Annotated[
        int,
        Meta(
            ge=-1,
            description="Train on at most this many rows of train_files (-1 or 0 = all; verl's data.train_max_samples): a random choice seeded by data.seed when shuffle is on, else the first rows.",
        ),
    ] = -1
    apply_chat_template: Annotated[
        bool,
        Meta(
            description="Render chat-message prompts with the tokenizer's chat template (a tokenizer without one is refused before the run starts); false, or a plain-string prompt: the text (a prompt's message contents joined by newlines) as the tokenizer encodes it, its BOS included (fleetrl.data.render)."
        ),
    ] = True
    shuffle: Annotated[
        bool, Meta(description="Shuffle each epoch deterministically from `seed`.")
    ] = True
    seed: Annotated[int, Meta(description="Shuffle seed.")] = 1
    val_max_samples: Annotated[
        int, Meta(ge=-1, description="Cap on validation prompts (-1 = all).")
    ] = -1
    synth_task: Annotated[
        Literal["", "add", "add2", "copy_last", "count", "calc", "calc_tool"],
        Meta(
            description="If set (add, add2, copy_last, count; calc, multi-turn with rollout.multi_turn.env=calculator; calc_tool, for an agent with a calculator tool) and the data files are missing, generate this synthetic task there (see fleetrl.data.synth)."
        ),
    ] = ""
    synth_train_size: Annotated[
        int, Meta(ge=1, description="Rows of the generated synthetic train file.")
    ] = 2000
    synth_test_size: Annotated[
        int,
        Meta(
            ge=1,
            description="Rows of the generated synthetic test file (held-out instances only).",
        ),
    ] = 200

    def __post_init__(self) -> None:
        # one path given as a string (verl's `data.train_files: ~/data/train.parquet`) is a
        # list of one; `~` is expanded here so that every reader of the config sees real paths
        self.train_files = _paths(self.train_files)
        self.val_files = _paths(self.val_files)

    def reader_options(self) -> dict[str, Any]:
        """Keyword arguments of ``fleetrl.data.reader.PromptReader`` these keys set."""
        return {
            "max_prompt_length": self.max_prompt_length,
            "apply_chat_template": self.apply_chat_template,
            "truncation": self.truncation,
        }


class PreferenceDataConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Data section of a reward-model run (`fleetrl rm train`): preference pairs."""

    train_files: Annotated[
        list[str] | str,
        Meta(
            description="Parquet files of preference pairs (prompt, chosen, rejected, optional margin; fleetrl.data.preference): a list, or one path as a string; a leading ~ is expanded."
        ),
    ] = []
    val_files: Annotated[
        list[str] | str,
        Meta(
            description="Held-out preference pairs: pairwise accuracy every trainer.test_freq steps, and the score statistics stored in the exported folder (without them, the statistics come from the training pairs)."
        ),
    ] = []
    train_batch_size: Annotated[
        int, Meta(ge=1, description="Pairs per optimizer step (global, over every rank).")
    ] = 64
    max_length: Annotated[
        int,
        Meta(
            ge=2,
            description="Most tokens of one sequence (prompt + response + EOS, after the chat template); a pair with a longer one is dropped and counted.",
        ),
    ] = 1024
    apply_chat_template: Annotated[
        bool,
        Meta(
            description="Render chat prompts with the tokenizer's template where it has one, the response as the assistant's message; plain-string prompts stay text (fleetrl.data.render, the rendering RL scoring uses with reward.model.apply_chat_template=auto)."
        ),
    ] = True
    shuffle: Annotated[
        bool, Meta(description="Shuffle each epoch deterministically from `seed`.")
    ] = True
    seed: Annotated[
        int, Meta(description="Shuffle seed (and the split of a generated synthetic set).")
    ] = 1
    val_max_pairs: Annotated[int, Meta(ge=-1, description="Cap on held-out pairs (-1 = all).")] = -1
    synth_task: Annotated[
        Literal["", "add2", "add2_even"],
        Meta(
            description="If set and the files are missing, generate this synthetic preference set there (fleetrl.data.synth_preference), on the RL task add2's own train/held-out split: add2_even (the CPU demo's: an even answer over an odd one), add2 (the correct sum over wrong ones)."
        ),
    ] = ""
    synth_train_size: Annotated[
        int, Meta(ge=1, description="Pairs of the generated synthetic train file.")
    ] = 4000
    synth_test_size: Annotated[
        int,
        Meta(
            ge=1,
            description="Pairs of the generated synthetic held-out file (held-out prompts only).",
        ),
    ] = 400

    def __post_init__(self) -> None:
        self.train_files = _paths(self.train_files)
        self.val_files = _paths(self.val_files)


def _paths(value: list[str] | str) -> list[str]:
    files = [value] if isinstance(value, str) else value
    return [os.path.expanduser(f) for f in files if f]
