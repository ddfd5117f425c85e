"""`fleetrl data gsm8k`: convert local GSM8K files into verl's Parquet schema.

Input is what Hugging Face's ``openai/gsm8k`` or verl's preparation leaves on
disk (nothing is downloaded): a folder holding ``train.jsonl``/``test.jsonl``
or ``train-*.parquet``/``test-*.parquet`` (also under a ``main/`` subfolder, as
in the HF repository), or one such file. Each record has ``question`` and
``answer``; the answer's last line is ``#### N``.

Output, per split, ``OUT/<split>.parquet`` with the same content verl writes:
the question plus verl's instruction suffix as a single user message,
``data_source`` "openai/gsm8k", ``ability`` "math", ``reward_model``
{style "rule", ground_truth} and ``extra_info`` {split, index, answer, question}.
The ground truth is taken by verl's ``extract_solution`` rule: the FIRST
``"#### "`` (one space) followed by ``-?[0-9.,]+``, commas removed; whatever
follows the number is ignored (``#### 5 apples`` -> "5", ``#### 72.`` -> "72.",
``#### .5`` -> ".5", ``#### ,5`` -> "5"). A record without such a marker, which
verl's script stops on with an assertion, is reported as a dataset error.

Run: ``fleetrl data gsm8k --input ~/data/gsm8k_raw --out data/gsm8k``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fleetrl.data.schema import DatasetError, write_rows
from fleetrl.log import get_logger

log = get_logger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
_ANSWER_RE = re.compile(r"#### (-?[0-9.,]+)")


def ground_truth_of(answer: str) -> str | None:
    """verl's ground truth of a GSM8K answer: the first ``#### N``, commas removed."""
    found = _ANSWER_RE.search(answer)
    return found.group(1).replace(",", "") if found else None


def find_split_files(root: Path, split: str) -> list[Path]:
    """GSM8K files of ``split`` under ``root`` (or ``root/main``), in name order."""
    patterns = (f"{split}.jsonl", f"{split}.parquet", f"{split}-*.parquet", f"{split}-*.jsonl")
    for folder in (root, root / "main"):
        found = sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})
        if found:
            return found
    return []


def read_records(file: Path) -> list[dict[str, Any]]:
    """Records of one GSM8K jsonl or Parquet file (no schema checks yet)."""
    if file.suffix == ".parquet":
        try:
            table = pq.read_table(file)
        except (pa.ArrowInvalid, OSError) as err:
            raise DatasetError(file, f"not a readable Parquet file: {err}") from None
        return table.to_pylist()
    records = []
    with file.open(encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DatasetError(file, f"not valid JSON: {err.msg}", row=index) from None
    return records


def convert_record(record: Any, *, split: str, index: int, file: Path) -> dict[str, Any]:
    """One GSM8K record as a schema row; ``DatasetError`` naming file, row and field if bad."""
    if not isinstance(record, dict):
        raise DatasetError(file, f"expected a JSON object, got {type(record).__name__}", row=index)
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str) or not record[field].strip():
            raise DatasetError(
                file,
                f"missing or not a non-empty string: {record.get(field)!r:.60}",
                row=index,
                field=field,
            )
    question, answer = record["question"], record["answer"]
    ground_truth = ground_truth_of(answer)
    if ground_truth is None:
        raise DatasetError(
            file,
            f"holds no '#### <number>': ...{answer[-60:]!r}",
            row=index,
            field="answer",
        )
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_split(files: list[Path], split: str, out_dir: Path) -> Path:
    rows = []
    for file in files:
        for record in read_records(file):
            rows.append(convert_record(record, split=split, index=len(rows), file=file))
    if not rows:
        raise DatasetError(files[0], f"no GSM8K records for split {split!r}")
    path = write_rows(rows, out_dir / f"{split}.parquet")
    log.info("wrote %d %s prompts to %s", len(rows), split, path)
    return path


def convert(input_path: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Convert a GSM8K folder (both splits) or one file (its split, read from its name)."""
    source, out = Path(input_path), Path(out_dir)
    if source.is_file():
        split = next((s for s in SPLITS if source.name.startswith(s)), None)
        if split is None:
            raise DatasetError(
                source, "cannot tell the split: the file name must start with train or test"
            )
        return {split: convert_split([source], split, out)}
    if not source.is_dir():
        raise DatasetError(
            source, "input not found (expected a folder or a GSM8K jsonl/parquet file)"
        )
    written = {}
    for split in SPLITS:
        files = find_split_files(source, split)
        if not files:
            raise DatasetError(
                source,
                f"no {split} file found; looked for {split}.jsonl, {split}.parquet, "
                f"{split}-*.parquet (also under main/)",
            )
        written[split] = convert_split(files, split, out)
    return written


def main(args: argparse.Namespace) -> int:
    try:
        convert(args.input, args.out)
    except DatasetError as err:
        # One line and status 2, like the CLI's own config errors.
        log.error("%s", err)
        return 2
    return 0
