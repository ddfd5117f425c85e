"""`fleetrl data hh-rlhf`: convert Anthropic's HH-RLHF into the preference Parquet schema.

Input is what the ``Anthropic/hh-rlhf`` repository leaves on disk (nothing is
downloaded): ``train.jsonl.gz`` / ``test.jsonl.gz`` files (or plain ``.jsonl``), in a
folder or its subset folders (``harmless-base/``, ``helpful-base/``, ...), or one such
file. Each line is ``{"chosen": transcript, "rejected": transcript}``, a transcript being
turns ``"\\n\\nHuman: ..."`` and ``"\\n\\nAssistant: ..."``.

Each pair becomes one row of ``fleetrl.data.preference``: ``prompt`` = the turns both
transcripts share, as chat messages (Human -> user, Assistant -> assistant),
``chosen`` / ``rejected`` = the last Assistant turn of each. Pairs that do not fit are
dropped and counted by reason:

- ``malformed``: a transcript that is not Human/Assistant turns ending with an Assistant turn;
- ``prompt_mismatch``: the two transcripts differ before their last turn;
- ``empty_response``: a last Assistant turn with no text;
- ``same_response``: both last turns are the same text.

A line that is not a JSON object with string ``chosen`` and ``rejected`` is an error
naming file and line: such a file is not HH-RLHF. The red-team subset (other fields) is
not a preference set and is not read (its files are not named train/test).

Output, per split found: ``OUT/<split>.parquet``, subsets concatenated in path order.

Run: ``fleetrl data hh-rlhf --input ~/data/hh-rlhf --out data/hh``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetrl.data.preference import write_preference_rows
from fleetrl.data.schema import DatasetError
from fleetrl.log import get_logger

log = get_logger(__name__)

SPLITS = ("train", "test")
DROP_REASONS = ("malformed", "prompt_mismatch", "empty_response", "same_response")
_TURN_RE = re.compile(r"\n\n(Human|Assistant): ?")
_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_transcript(text: str) -> list[tuple[str, str]] | None:
    """(role, content) turns of an HH transcript, or None if it is not one."""
    text = "\n\n" + text.lstrip() if not text.startswith("\n\n") else text
    parts = _TURN_RE.split(text)
    if parts[0].strip() or len(parts) < 3:
        return None
    turns = [(_ROLES[role], content.strip()) for role, content in zip(parts[1::2], parts[2::2], strict=True)]  # fmt: skip
    if turns[0][0] != "user" or turns[-1][0] != "assistant":
        return None
    return turns


def convert_pair(chosen: str, rejected: str) -> tuple[dict[str, Any] | None, str | None]:
    """(preference row, None) for a usable pair, else (None, the drop reason)."""
    chosen_turns, rejected_turns = parse_transcript(chosen), parse_transcript(rejected)
    if chosen_turns is None or rejected_turns is None:
        return None, "malformed"
    if chosen_turns[:-1] != rejected_turns[:-1]:
        return None, "prompt_mismatch"
    chosen_text, rejected_text = chosen_turns[-1][1], rejected_turns[-1][1]
    if not chosen_text or not rejected_text:
        return None, "empty_response"
    if chosen_text == rejected_text:
        return None, "same_response"
    prompt = [{"role": role, "content": content} for role, content in chosen_turns[:-1]]
    return {"prompt": prompt, "chosen": chosen_text, "rejected": rejected_text}, None


@dataclass
class SplitReport:
    split: str
    files: list[Path]
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    out: Path | None = None

    def line(self) -> str:
        drops = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items() if n) or "none"
        total = self.kept + sum(self.dropped.values())
        return f"{self.split}: kept {self.kept} of {total} pairs (dropped: {drops}) -> {self.out}"


def _lines(file: Path):
    opener = gzip.open if file.name.endswith(".gz") else open
    try:
        with opener(file, "rt", encoding="utf-8") as handle:
            yield from handle
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise DatasetError(file, f"cannot read: {err}") from None


def read_pairs(file: Path, report: SplitReport) -> list[dict[str, Any]]:
    rows = []
    for index, line in enumerate(_lines(file)):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(file, f"not valid JSON: {err.msg}", row=index) from None
        if not isinstance(record, dict):
            raise DatasetError(file, f"expected a JSON object, got {type(record).__name__}", row=index)  # fmt: skip
        for key in ("chosen", "rejected"):
            if not isinstance(record.get(key), str):
                raise DatasetError(file, f"expected a transcript string, got {record.get(key)!r:.60}", row=index, field=key)  # fmt: skip
        row, reason = convert_pair(record["chosen"], record["rejected"])
        if row is None:
            report.dropped[str(reason)] += 1
        else:
            rows.append(row)
    report.kept += len(rows)
    return rows


def find_split_files(root: Path, split: str) -> list[Path]:
    """``<split>.jsonl[.gz]`` files under ``root`` (any depth), in path order."""
    names = (f"{split}.jsonl", f"{split}.jsonl.gz")
    return sorted(p for p in root.rglob(f"{split}.jsonl*") if p.is_file() and p.name in names)


def convert(input_path: str | Path, out_dir: str | Path) -> list[SplitReport]:
    """Convert a folder (every split found) or one file (its split, from its name)."""
    source, out = Path(input_path), Path(out_dir)
    if source.is_file():
        split = next((s for s in SPLITS if source.name.startswith(s)), None)
        if split is None:
            raise DatasetError(source, "cannot tell the split: the file name must start with train or test")  # fmt: skip
        plan = {split: [source]}
    elif source.is_dir():
        plan = {s: files for s in SPLITS if (files := find_split_files(source, s))}
        if not plan:
            raise DatasetError(source, "no train.jsonl[.gz] or test.jsonl[.gz] found (also looked in subfolders)")  # fmt: skip
    else:
        raise DatasetError(source, "input not found (expected a folder or an HH-RLHF jsonl[.gz] file)")  # fmt: skip
    reports = []
    for split, files in plan.items():
        report = SplitReport(split, files)
        rows = [row for file in files for row in read_pairs(file, report)]
        if not rows:
            raise DatasetError(files[0], f"no usable pairs for split {split!r}: {report.line()}")
        report.out = write_preference_rows(rows, out / f"{split}.parquet")
        log.info("%s", report.line())
        reports.append(report)
    return reports


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl data hh-rlhf`` (a bad file raises DatasetError, a ValueError)."""
    for report in convert(args.input, args.out):
        print(report.line())  # the CLI's result
    return 0
