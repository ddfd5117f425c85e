"""The prompt dataset schema (verl's Parquet layout): validation, reading and writing.

One row is one prompt (docs/data.md has the table and a pyarrow example)::

    data_source   str                              which scorer grades it ("openai/gsm8k")
    prompt        list[{role: str, content: str}]  chat messages, rendered by the chat template,
                  | str                            or plain text, encoded as it is
    reward_model  {style: str, ground_truth: str}  what the scorer compares against
    ability       str (optional)                   free-form tag ("math"); "" when absent
    extra_info    {...} (optional)                 anything else the scorer or analysis needs
                                                   (verl writes split and index); {} when absent

A file that does not follow it fails with ``DatasetError`` naming the file, the
row index (0-based, in file order) and the field. ``file_problems`` lists every
problem of a file at once (a missing column, or the first bad row per field with
how many rows share it): ``fleetrl check`` and ``fleetrl train``'s preflight report
them before anything starts, and the rollout's reader refuses the same rows.

Left out: other columns are ignored (not rejected) when read; ``ground_truth`` must
be a string (lists or dicts of answers are not supported).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
OPTIONAL_COLUMNS = ("ability", "extra_info")
COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
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


def validate_prompt(prompt: Any, fail: Callable[[str, str], DatasetError]) -> None:
    """Raise ``fail(field, problem)`` unless ``prompt`` is a non-empty string or a non-empty
    list of {role, content} messages."""
    if isinstance(prompt, str):
        if not prompt:
            raise fail("prompt", "expected a non-empty string or list of messages, got ''")
        return
    if not isinstance(prompt, list) or not prompt:
        raise fail(
            "prompt",
            "expected a string or a non-empty list of {role, content} messages, got "
            f"{_type_name(prompt)} {prompt!r:.60}",
        )
    validate_messages(prompt, fail)


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
    validate_prompt(row["prompt"], fail)

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

    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise fail("ability", f"expected a string, got {_type_name(ability)}")
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise fail("extra_info", f"expected a mapping, got {extra_info!r:.80}")


def validate_columns(schema: pa.Schema, *, file: str | Path) -> None:
    """Raise ``DatasetError`` if a required column is absent from a Parquet schema."""
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise DatasetError(
            file,
            f"missing column(s) {', '.join(missing)}; found {', '.join(schema.names) or 'none'} "
            f"(a prompt file has {', '.join(REQUIRED_COLUMNS)}, and optionally "
            f"{', '.join(OPTIONAL_COLUMNS)}: docs/data.md)",
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


def _raw_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of the file's schema columns, unvalidated (a missing column raises)."""
    parquet = open_parquet(path)
    validate_columns(parquet.schema_arrow, file=path)
    present = [c for c in COLUMNS if c in parquet.schema_arrow.names]
    return parquet.read(columns=present).to_pylist()


def _with_defaults(row: dict[str, Any]) -> dict[str, Any]:
    """A valid row with its optional columns filled: ``ability`` "", ``extra_info`` {}."""
    if row.get("ability") is None:
        row["ability"] = ""
    if row.get("extra_info") is None:
        row["extra_info"] = {}
    return row


def read_rows(file: str | Path) -> list[dict[str, Any]]:
    """Every row of one Parquet file as validated dicts (only the schema's columns are read;
    absent optional ones filled with their defaults)."""
    path = Path(file)
    rows = _raw_rows(path)
    for index, row in enumerate(rows):
        validate_row(row, file=path, index=index)
    return [_with_defaults(row) for row in rows]


def file_problems(file: str | Path) -> tuple[list[DatasetError], list[dict[str, Any]]]:
    """Every problem of one file, at once, and its valid rows (defaults filled).

    A missing or unreadable file or a missing column is one problem; otherwise the first
    bad row of each field, its ``problem`` ending with how many more rows share it.
    """
    path = Path(file)
    try:
        rows = _raw_rows(path)
    except DatasetError as err:
        return [err], []
    if not rows:
        return [DatasetError(path, "holds no rows")], []
    first: dict[str | None, DatasetError] = {}
    more: dict[str | None, int] = {}
    good = []
    for index, row in enumerate(rows):
        try:
            validate_row(row, file=path, index=index)
        except DatasetError as err:
            if err.field in first:
                more[err.field] = more.get(err.field, 0) + 1
            else:
                first[err.field] = err
            continue
        good.append(_with_defaults(row))
    problems = []
    for field, err in first.items():
        if more.get(field):
            err = DatasetError(
                err.file, f"{err.problem} (and {more[field]} more rows)", row=err.row, field=field
            )
        problems.append(err)
    return problems, good


def _prompt_type(prompts: list[Any], path: Path) -> pa.DataType:
    """One Arrow type for the prompt column: all plain strings, or all message lists."""
    if all(isinstance(p, str) for p in prompts):
        return pa.string()
    if any(isinstance(p, str) for p in prompts):
        raise DatasetError(
            path, "prompts are a mix of strings and message lists; one column holds one type"
        )
    return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def write_rows(rows: Iterable[Mapping[str, Any]], file: str | Path) -> Path:
    """Validate ``rows`` and write them as one Parquet file (parent folders are created);
    an optional column is written when any row has it."""
    path = Path(file)
    rows = [dict(r) for r in rows]
    for index, row in enumerate(rows):
        validate_row(row, file=path, index=index)
    prompts = [row["prompt"] for row in rows]
    columns = {
        "data_source": pa.array([row["data_source"] for row in rows], pa.string()),
        "prompt": pa.array(prompts, _prompt_type(prompts, path)),
        "reward_model": pa.array(
            [row["reward_model"] for row in rows],
            pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
        ),
    }
    if any(row.get("ability") is not None for row in rows):
        columns["ability"] = pa.array([row.get("ability") for row in rows], pa.string())
    if any(row.get("extra_info") is not None for row in rows):
        # extra_info is task-specific: let Arrow infer its struct type.
        columns["extra_info"] = pa.array([row.get("extra_info") for row in rows])
    order = [c for c in ("data_source", "prompt", "ability", "reward_model", "extra_info") if c in columns]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({c: columns[c] for c in order}), path)
    return path
