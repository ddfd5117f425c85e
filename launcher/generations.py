"""Validation samples a user reads (``trainer.log_val_generations``, verl's key).

``GenerationLog.write(step, policy_version, samples)`` appends one JSON object per sample
to ``<run dir>/generations.jsonl`` (``step``, ``policy_version`` and every field of
``rollout_fleet.validation.ValSample``: prompt, response, score, data_source,
ground_truth, response_length, finish_reason, the versions that generated it, turns, the
reward function's other values) and returns the rows, which the tracker also sends to
wandb as one table (``val/generations``, every validation's rows so far, as verl's
``ValidationGenerationsLogger`` does) and to MLflow. Read the file back with
``read_generations``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from rollout_fleet.validation import ValSample

FILE = "generations.jsonl"
WANDB_KEY = "val/generations"
WANDB_COLUMNS = (
    "step", "policy_version", "index", "data_source", "prompt", "response", "ground_truth",
    "score", "response_length", "finish_reason",
)  # fmt: skip


class GenerationLog:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / FILE
        self.table_rows: list[list[Any]] = []  # the wandb table: every validation's rows

    def write(
        self, step: int, policy_version: int, samples: list[ValSample]
    ) -> list[dict[str, Any]]:
        rows = [{"step": step, "policy_version": policy_version, **msgspec.to_builtins(s)} for s in samples]  # fmt: skip
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self.table_rows += [[row[c] for c in WANDB_COLUMNS] for row in rows]
        return rows


def read_generations(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
