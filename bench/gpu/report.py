"""The GPU check's results: one typed record per stage, the JSON report, the console table.

Every stage ends as ``ok``, ``failed`` (``why``: the error's first line, or the check that
did not hold) or ``skipped`` (``why``: what it needs that this machine lacks, or that the
time budget ran out). Figures a stage measured before it failed or ran out of time are kept.

The report folder is what a remote run brings back from ``$OUT``: at most 8 files of
at most 16 MiB, no deeper than ``$OUT/a/b/file``, names of letters, digits, ``.``, ``_``
and ``-``. ``out_folder_problems`` says what in a folder breaks those rules, so a test
can hold the check to them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench.common import now_iso, write_json

# "running": a result a stage saved before it ended; the driver never reports one
Status = Literal["ok", "failed", "skipped", "running"]
REPORT_NAME = "gpu_check.json"
LOG_NAME = "gpu_check.log"
OUT_MAX_FILES = 8
OUT_MAX_FILE_BYTES = 16 * 1024 * 1024
OUT_MAX_DEPTH = 3  # $OUT/a/b/file: three parts
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class StageResult:
    name: str
    status: Status = "failed"
    why: str = ""
    seconds: float = 0.0
    limit_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def first_line(text: str, limit: int = 400) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0][:limit] if stripped else ""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        shown = ", ".join(_fmt(v) for v in value[:6])
        return f"[{shown}{', ...' if len(value) > 6 else ''}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_fmt(v)}" for k, v in list(value.items())[:4]) + "}"
    return str(value)


def headline(result: StageResult, keys: Sequence[str] = (), count: int = 8) -> str:
    """The stage's reason, or its figures named in ``keys`` (else its first scalar ones)."""
    if result.why:
        return result.why
    if keys:
        chosen = [(k, result.figures[k]) for k in keys if k in result.figures]
    else:
        chosen = [(k, v) for k, v in result.figures.items() if not isinstance(v, dict | list)]
    return ", ".join(f"{k}={_fmt(v)}" for k, v in chosen[:count])


def render_table(
    results: list[StageResult], headlines: Mapping[str, Sequence[str]] | None = None
) -> str:
    """Fixed-width: stage, status, seconds of its limit, headline figures or why."""
    lines = [f"{'stage':<18} {'status':<8} {'seconds':>13}  figures / why"]
    for r in results:
        secs = f"{r.seconds:.1f}/{r.limit_s:.0f}" if r.limit_s else f"{r.seconds:.1f}"
        keys = (headlines or {}).get(r.name, ())
        lines.append(f"{r.name:<18} {r.status:<8} {secs:>13}  {headline(r, keys)}")
    return "\n".join(lines)


def overall(results: list[StageResult]) -> bool:
    """True when no stage failed (skipped stages are reported, not failures)."""
    return all(r.status != "failed" for r in results)


def write_report(
    out: Path,
    results: list[StageResult],
    *,
    machine: dict[str, Any],
    config: dict[str, Any],
    summary: dict[str, Any] | None = None,
) -> Path:
    """``out/gpu_check.json``: every stage with its status, why, seconds and figures."""
    report = {
        "ok": overall(results),
        "finished_at": now_iso(),
        "counts": {s: sum(r.status == s for r in results) for s in ("ok", "failed", "skipped")},
        "summary": summary or {},
        "machine": machine,
        "config": config,
        "stages": [asdict(r) for r in results],
    }
    return write_json(out / REPORT_NAME, report)


def out_folder_problems(out: Path) -> list[str]:
    """What in ``out`` a remote run would not bring back (empty: everything comes back)."""
    problems = []
    files = [p for p in sorted(out.rglob("*")) if not p.is_dir()]
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} files, at most {OUT_MAX_FILES} come back")
    for path in files:
        rel = path.relative_to(out)
        if path.is_symlink() or not path.is_file():
            problems.append(f"{rel}: not a plain file")
        elif path.stat().st_size > OUT_MAX_FILE_BYTES:
            problems.append(f"{rel}: {path.stat().st_size} bytes, over 16 MiB")
        if len(rel.parts) > OUT_MAX_DEPTH:
            problems.append(f"{rel}: deeper than $OUT/a/b/file")
        bad = [part for part in rel.parts if not OUT_NAME.match(part)]
        if bad:
            problems.append(f"{rel}: a name with other characters than letters, digits, . _ -")
    return problems
