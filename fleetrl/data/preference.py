"""The preference dataset schema (Parquet): validation, reading and writing.

One row is one comparison::

    prompt    list[{role: str, content: str}] | str   the conversation so far (verl's chat
                                                      messages, as the RL data holds them) or
                                                      a plain prompt string
    chosen    str                                     the preferred response
    rejected  str                                     the other response
    margin    float (optional; null reads as 0)       how much more chosen is preferred: the
                                                      Bradley-Terry loss is
                                                      -log σ(r_chosen - r_rejected - margin)

A file that does not follow it fails with ``DatasetError`` naming the file and, for a
bad value, the row and field (a missing column, a response that is not a string, a
message without a role). Rows that follow it but cannot teach anything are not errors:
``fleetrl.data.pairs`` counts and drops them (empty texts, identical responses, pairs
longer than the token budget), as the RL prompt reader drops over-long prompts.

Other columns are ignored (not rejected), so HH-RLHF or UltraFeedback exports with extra
fields read as they are once they have these four.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fleetrl.data.schema import DatasetError, open_parquet, validate_messages

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")
OPTIONAL_COLUMNS = ("margin",)
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def validate_preference_row(row: Any, *, file: str | Path, index: int) -> None:
    """Raise ``DatasetError`` unless ``row`` (a dict, as ``to_pylist`` gives) has the schema."""

    def fail(field: str, problem: str) -> DatasetError:
        return DatasetError(file, problem, row=index, field=field)

    if not isinstance(row, Mapping):
        raise DatasetError(file, f"row is a {type(row).__name__}, not a mapping", row=index)
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        validate_messages(prompt, fail)
    elif not isinstance(prompt, str):
        raise fail("prompt", f"expected a string or a list of messages, got {type(prompt).__name__}")  # fmt: skip
    for field in ("chosen", "rejected"):
        if not isinstance(row.get(field), str):
            raise fail(field, f"expected a string, got {type(row.get(field)).__name__}")
    margin = row.get("margin")
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin)
    ):
        raise fail("margin", f"expected a finite number, got {margin!r:.40}")


def read_preference_rows(file: str | Path) -> list[dict[str, Any]]:
    """Every row of one preference Parquet file as validated dicts (``margin`` filled in)."""
    path = Path(file)
    parquet = open_parquet(path)
    names = parquet.schema_arrow.names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DatasetError(
            path,
            f"missing column(s) {', '.join(missing)}; found {', '.join(names) or 'none'} "
            f"(a preference file has {', '.join(REQUIRED_COLUMNS)} and optionally margin)",
            field=missing[0],
        )
    columns = [*REQUIRED_COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in names)]
    rows = parquet.read(columns=columns).to_pylist()
    for index, row in enumerate(rows):
        validate_preference_row(row, file=path, index=index)
        row["margin"] = float(row.get("margin") or 0.0)
    return rows


def write_preference_rows(rows: Iterable[Mapping[str, Any]], file: str | Path) -> Path:
    """Validate ``rows`` and write them as one Parquet file (parent folders are created).

    The prompt column is chat messages when every row's prompt is a list, else strings
    (a file holds one kind). ``margin`` is written when any row has one.
    """
    path = Path(file)
    rows = [dict(r) for r in rows]
    for index, row in enumerate(rows):
        validate_preference_row(row, file=path, index=index)
    as_messages = all(isinstance(r["prompt"], list) for r in rows)
    if not as_messages and any(isinstance(r["prompt"], list) for r in rows):
        raise DatasetError(path, "prompts mix chat messages and plain strings", field="prompt")
    columns = {
        "prompt": pa.array([r["prompt"] for r in rows], MESSAGES_TYPE if as_messages else pa.string()),
        "chosen": pa.array([r["chosen"] for r in rows], pa.string()),
        "rejected": pa.array([r["rejected"] for r in rows], pa.string()),
    }  # fmt: skip
    if any(r.get("margin") is not None for r in rows):
        columns["margin"] = pa.array([r.get("margin") for r in rows], pa.float64())
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path
