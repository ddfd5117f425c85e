"""The prompt dataset schema (verl's Parquet layout): validation, reading and writing.

One row is one prompt::

    data_source   str                          which scorer grades it ("openai/gsm8k", "synth/add")
    prompt        list[{role: str, content: str}]   chat messages, rendered by the chat template,
                  | str                              or a plain string (fleetrl.data.render)
    ability       str                          free-form tag ("math", "synth")
    reward_model  {style: str, ground_truth: str}
    extra_info    {split: str, index: int, ...}     anything else the scorer or analysis needs

A file that does not follow it fails with ``DatasetError`` naming the file, the
row index (0-based, in file order) and the field, before any training starts.

Left out: verl's optional extra columns are ignored (not rejected) when read;
``ground_truth`` must be a string (lists or dicts of answers are not supported).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
REQUIRED_EXTRA_INFO = ("split", "index")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A dataset problem, naming the file and, where it applies, the row and field."""

    def __init__(
        self, file: str | Path, problem: str, *, row: int | None = None, field: str | None = None
    ) -> None:
        self.file = str(file)
        self.row = row
        self.field = field
        self.problem = problem
        where = self.file
        if row is not None:
            where += f": row {row}"
        if field is not None:
            where += f": field {field!r}"
        super().__init__(f"dataset error in {where}: {problem}")


def _type_name(value: Any) -> str:
    return type(value).__name__


def validate_messages(messages: list[Any], fail: Callable[[str, str], DatasetError]) -> None:
    """Raise ``fail(field, problem)`` unless every message is a {role, content} of strings."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise fail(f"prompt[{i}]", f"expected a {{role, content}} mapping, got {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            raise fail(f"prompt[{i}].role", f"got {role!r}; accepted: {', '.join(MESSAGE_ROLES)}")
        if not isinstance(content, str):
            raise fail(f"prompt[{i}].content", f"expected a string, got {_type_name(content)}")


def validate_row(row: Any, *, file: str | Path, index: int) -> None:
    """Raise ``DatasetError`` unless ``row`` (a dict, as ``to_pylist`` gives) follows the schema."""

    def fail(field: str, problem: str) -> DatasetError:
        return DatasetError(file, problem, row=index, field=field)

    if not isinstance(row, Mapping):
        raise DatasetError(file, f"row is a {_type_name(row)}, not a mapping", row=index)
    for column in REQUIRED_COLUMNS:
        if column not in row:
            raise fail(column, "missing")

    source = row["data_source"]
    if not isinstance(source, str) or not source:
        raise fail("data_source", f"expected a non-empty string, got {source!r}")
    if not isinstance(row["ability"], str):
        raise fail("ability", f"expected a string, got {_type_name(row['ability'])}")

    prompt = row["prompt"]
    if isinstance(prompt, str) and prompt:
        pass  # a plain-string prompt: the text itself (fleetrl.data.render)
    elif not isinstance(prompt, list) or not prompt:
        raise fail(
            "prompt",
            f"expected a non-empty string or list of {{role, content}} messages, got {prompt!r:.80}",
        )
    else:
        validate_messages(prompt, fail)

    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping):
        raise fail(
            "reward_model", f"expected a {{style, ground_truth}} mapping, got {reward_model!r:.80}"
        )
    if not isinstance(reward_model.get("style"), str):
        raise fail("reward_model.style", f"expected a string, got {reward_model.get('style')!r}")
    if not isinstance(reward_model.get("ground_truth"), str):
        raise fail(
            "reward_model.ground_truth",
            f"expected a string, got {_type_name(reward_model.get('ground_truth'))}",
        )

    extra_info = row["extra_info"]
    if not isinstance(extra_info, Mapping):
        raise fail("extra_info", f"expected a mapping, got {extra_info!r:.80}")
    for key in REQUIRED_EXTRA_INFO:
        if key not in extra_info or extra_info[key] is None:
            raise fail(f"extra_info.{key}", "missing")
    if not isinstance(extra_info["split"], str):
        raise fail("extra_info.split", f"expected a string, got {extra_info['split']!r}")
    if not isinstance(extra_info["index"], int) or isinstance(extra_info["index"], bool):
        raise fail("extra_info.index", f"expected an integer, got {extra_info['index']!r}")


def validate_columns(schema: pa.Schema, *, file: str | Path) -> None:
    """Raise ``DatasetError`` if a required column is absent from a Parquet schema."""
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise DatasetError(
            file,
            f"missing column(s) {', '.join(missing)}; found {', '.join(schema.names) or 'none'} "
            f"(expected verl's schema: {', '.join(REQUIRED_COLUMNS)})",
            field=missing[0],
        )


def open_parquet(path: Path) -> pq.ParquetFile:
    """The Parquet file at ``path``; ``DatasetError`` if it is missing or unreadable."""
    if not path.is_file():
        raise DatasetError(path, "file not found")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(path, f"not a readable Parquet file: {err}") from None


def read_rows(file: str | Path) -> list[dict[str, Any]]:
    """Every row of one Parquet file as validated dicts (only the schema's columns are read)."""
    path = Path(file)
    parquet = open_parquet(path)
    validate_columns(parquet.schema_arrow, file=path)
    rows = parquet.read(columns=list(REQUIRED_COLUMNS)).to_pylist()
    for index, row in enumerate(rows):
        validate_row(row, file=path, index=index)
    return rows


def _prompt_type(prompts: list[Any]) -> pa.DataType:
    """A string column when every prompt is a plain string, else chat messages."""
    if prompts and all(isinstance(p, str) for p in prompts):
        return pa.string()
    return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def write_rows(rows: Iterable[Mapping[str, Any]], file: str | Path) -> Path:
    """Validate ``rows`` and write them as one Parquet file (parent folders are created)."""
    path = Path(file)
    rows = [dict(r) for r in rows]
    for index, row in enumerate(rows):
        validate_row(row, file=path, index=index)
    columns = {c: [row[c] for row in rows] for c in REQUIRED_COLUMNS}
    table = pa.table(
        {
            "data_source": pa.array(columns["data_source"], pa.string()),
            "prompt": pa.array(columns["prompt"], _prompt_type(columns["prompt"])),
            "ability": pa.array(columns["ability"], pa.string()),
            "reward_model": pa.array(
                columns["reward_model"],
                pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
            ),
            # extra_info is task-specific: let Arrow infer its struct type.
            "extra_info": pa.array(columns["extra_info"]),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path
