"""What every suite shares: machine facts, alternating repetitions, medians, JSON records.

A suite record is one JSON object per suite (``DIR/<suite>.json``)::

    {"schema_version": 1, "suite": "transport", "status": "ok" | "error",
     "error": null | "one line", "started_at": ISO time, "wall_s": float,
     "machine": machine_info(), "config": {...}, "results": {...},
     "summary": {"vs_ray_queue": 3.1, ...}, "sweep": optional}

``sweep`` (optional) is what ``bench.report`` plots as throughput against size::

    {"x": "hidden", "unit": "tokens/s",
     "rows": [{"x": 64, "series": {"fleetrl": 123.0, "hf generate": 50.0}}, ...]}

``alternate`` runs competing measurements in turn (A B A B ... after a warm-up of
each), so a burst of load from a neighbour on this shared machine hits both
sides, then the medians are compared. Left out: statistics beyond median,
min and max (with few repetitions on a noisy machine, anything finer is noise).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger

log = get_logger(__name__)

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
# Distributions whose versions every record carries (looked up without importing them).
VERSIONED_PACKAGES = (
    "torch",
    "ray",
    "pyzmq",
    "msgspec",
    "pyarrow",
    "numpy",
    "transformers",
    "sglang",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def git_commit() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files changed (None without git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def package_versions(names: tuple[str, ...] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution (None when absent)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _accelerators() -> list[str]:
    """CUDA device names, only if torch is already imported (never import it just for this)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine_info() -> dict[str, Any]:
    """Facts that make a figure comparable: CPU, cores, memory, accelerators, versions, commit."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "memory_gib": _memory_gib(),
        "accelerators": _accelerators(),
        "versions": package_versions(),
        "git_commit": git_commit(),
    }


def end_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a child started with ``start_new_session=True`` and what it started in its
    session, by its pid: SIGTERM (its cleanup runs), then SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)  # the group we started, by its id
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def median(values: list[float]) -> float:
    """Median of finite values (NaN when there are none)."""
    finite = sorted(v for v in values if isinstance(v, int | float) and math.isfinite(v))
    if not finite:
        return math.nan
    mid = len(finite) // 2
    return float(finite[mid]) if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2.0


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing, non-finite or the divisor is 0."""
    if numerator is None or denominator is None:
        return None
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator == 0:
        return None
    return numerator / denominator


def stats(values: list[float]) -> dict[str, Any]:
    """Every repetition plus its median, min and max."""
    finite = [v for v in values if math.isfinite(v)]
    return {
        "reps": list(values),
        "median": median(values),
        "min": min(finite) if finite else math.nan,
        "max": max(finite) if finite else math.nan,
    }


def alternate(
    measures: Mapping[str, Callable[[], float]], reps: int, **options: Any
) -> dict[str, dict[str, Any]]:
    """Run every measurement ``warmup`` times (discarded), then ``reps`` rounds in alternation.

    Round r runs the measurements in order, reversed on odd rounds (A B, B A, A B ...),
    so neither side always runs right after the other. Each callable returns one
    figure (higher is better, e.g. items/s). Returns ``{name: stats(...)}``. With
    ``deadline`` (``time.monotonic()``) rounds stop once it has passed, after at least one.
    ``options``: ``alternate_rounds``'s (warmup, progress, label, deadline).
    """
    figures = alternate_rounds(measures, reps, **options)
    return {name: stats(values) for name, values in figures.items()}


def alternate_rounds(
    measures: Mapping[str, Callable[[], float]],
    reps: int,
    *,
    warmup: int = 1,
    progress: Progress | None = None,
    label: str = "",
    deadline: float | None = None,
) -> dict[str, list[float]]:
    """``alternate``'s rounds: every measurement's figure of each round, in round order."""
    if reps < 1:
        raise ValueError(f"alternate: reps must be >= 1, got {reps}")
    names = list(measures)
    for _ in range(warmup):
        for name in names:
            measures[name]()
    figures: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(reps):
        if round_index and deadline is not None and time.monotonic() >= deadline:
            break
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            figures[name].append(float(measures[name]()))
        if progress is not None:
            latest = ", ".join(f"{n}={figures[n][-1]:.4g}" for n in names)
            progress.note(f"{label} rep {round_index + 1}/{reps}: {latest}")
    return figures


class Progress:
    """Progress lines of one suite run, through the logger (stderr), with elapsed time."""

    def __init__(self, suite: str, total: int | None = None) -> None:
        self.suite = suite
        self.total = total
        self.done = 0
        self._start = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    def note(self, message: str) -> None:
        log.info("[bench %s +%.0fs] %s", self.suite, self.elapsed_s, message)

    def step(self, message: str) -> None:
        """One unit of the suite done (``done/total`` shown when the total is known)."""
        self.done += 1
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        self.note(f"({count}) {message}")


def _clean(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, tuples lists, paths strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, int | str | bool) or value is None:
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return _clean(value.item())
    return str(value)


def write_json(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` as indented JSON atomically (temp file + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_clean(record), indent=2, sort_keys=False) + "\n")
    tmp.replace(target)
    return target


def read_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def suite_record(
    suite: str,
    *,
    config: Mapping[str, Any],
    results: Mapping[str, Any] | None = None,
    summary: Mapping[str, Any] | None = None,
    sweep: Mapping[str, Any] | None = None,
    error: str | None = None,
    started_at: str | None = None,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """The standard envelope of a suite's JSON (see the module docstring)."""
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "suite": suite,
        "status": "error" if error else "ok",
        "error": error,
        "started_at": started_at or now_iso(),
        "wall_s": wall_s,
        "machine": machine_info(),
        "config": dict(config),
        "results": dict(results or {}),
        "summary": dict(summary or {}),
    }
    if sweep:
        record["sweep"] = dict(sweep)
    return record


def declare_suite(out_dir: str | Path, suite: str, config: Mapping[str, Any]) -> None:
    """Write the suite's config before any run (status error, "running: no figures yet"),
    so a reader can check that what the figures are about was not chosen after them."""
    write_json(
        suite_json_path(out_dir, suite),
        suite_record(suite, config=config, error="running: no figures yet"),
    )


def write_suite(
    out_dir: str | Path,
    suite: str,
    *,
    config: Mapping[str, Any],
    results: Mapping[str, Any],
    summary: Mapping[str, Any],
    started: float,
    sweep: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a finished suite's ``DIR/<suite>.json`` (``started``: its ``time.monotonic()``
    at the start) and return what its ``run`` returns: config, results, summary (sweep)."""
    write_json(
        suite_json_path(out_dir, suite),
        suite_record(
            suite,
            config=config,
            results=results,
            summary=summary,
            sweep=sweep,
            wall_s=time.monotonic() - started,
        ),
    )
    out = {"config": config, "results": results, "summary": summary}
    return {**out, "sweep": sweep} if sweep is not None else out


def suite_json_path(out_dir: str | Path, suite: str) -> Path:
    """``DIR/<suite>.json`` with the suite's CLI name (``weight-sync.json``)."""
    return Path(out_dir) / f"{suite}.json"
