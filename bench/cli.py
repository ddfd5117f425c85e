"""``fleetrl bench SUITE --out DIR [--quick] [size flags]``: run suites, write JSON, table, plots.

One suite runs in this process: its module's ``run(out_dir, quick, reps, ...)`` is
called with the size flags it accepts (matched by name, see ``SIZE_PARAMETERS``;
flags it does not take are recorded as ``ignored_flags``), and its result is
written to ``DIR/<suite>.json`` inside the standard envelope of
``bench.common.suite_record``. ``all`` runs each suite in a child process of its
own (``python -m launcher.cli bench SUITE ...``) so a crash, a hang or leaked
state (Ray, process groups) in one cannot spoil the next; with ``--quick`` the
children share a deadline that keeps the whole run under about 35 minutes (e2e,
every η twice, the accuracy suite and the reward suite's e2e half, whole training runs,
take most of it). A suite
that is missing, fails or times out still gets its JSON, with ``status: error``
and a one-line ``error`` (``suite unavailable: ...``), and the table shows it.
Either way ``bench.report`` then writes ``report.md`` and the plots (in the parent
only: a child of ``all`` runs with ``FLEETRL_BENCH_CHILD=1`` and just writes its JSON).

Exit status: 0 when every requested suite succeeded, 1 otherwise (files are
written either way).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench import report
from bench.common import (
    REPO_ROOT,
    Progress,
    end_process_group,
    now_iso,
    read_json,
    suite_json_path,
    suite_record,
    write_json,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

# CLI suite name -> module whose ``run`` measures it
SUITE_MODULES: dict[str, str] = {
    "transport": "bench.transport",
    "weight-sync": "bench.weight_sync",
    "rollout": "bench.rollout",
    "learner": "bench.learner",
    "e2e": "bench.e2e",
    "accuracy": "bench.accuracy",
    "reward": "bench.reward",
    "agent": "bench.agent",
    "vs-trl": "bench.vs_trl",
}
# harness flag -> parameter names a suite's ``run`` may use for it (first match wins)
SIZE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden", "hidden_sizes", "sizes"),
    "layers": ("layers", "num_layers"),
    "engines": ("engines", "num_engines"),
    "learner_ranks": ("learner_ranks", "num_ranks", "ranks", "world_size"),
    "batch": ("batch", "batch_size"),
    "max_new_tokens": ("max_new_tokens",),
    "device": ("device",),
    "headline_eta": ("headline_eta",),
    "placement": ("placement",),
    "elastic": ("elastic",),
    "regime": ("regime_name",),
}
CHILD_ENV = "FLEETRL_BENCH_CHILD"  # set for the children of `all`: the parent reports
# --quick: seconds each child may run in `all` (unused time passes on to the next suite)
QUICK_BUDGET_S: dict[str, float] = {
    "transport": 60.0,
    "weight-sync": 60.0,
    "rollout": 300.0,  # the default sizes, 3 repetitions (bench.rollout): 220 s measured
    "learner": 80.0,
    "e2e": 600.0,
    "accuracy": 540.0,
    # batched vs per-sample (a server, 256 samples x (5 reps + warm-up) x 2 arms: ~60 s),
    # then the e2e half: a warm start and 4 training runs (473 s in all at load 6-8)
    "reward": 540.0,
    "agent": 420.0,  # gateway overhead rounds, then the agent demo at eta 0 and 2
    # the demo (3 arms x 3 seeds, ~15-30 s a run) and one generation-bound seed
    "vs-trl": 900.0,
}


class SuiteUnavailable(ValueError):
    """The suite's module or its ``run`` cannot be used."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fleetrl bench``'s arguments: the suite, where to write, repetitions and size flags."""
    p.add_argument(
        "suite",
        choices=[*SUITE_MODULES, "all"],
        help="the stage to measure against its baseline, or all",
    )
    p.add_argument("--out", required=True, help="folder for the report, figures and plots")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions, and smaller sizes where a suite's figure does not depend on them",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    p.add_argument(
        "--hidden", type=int, nargs="*", default=None, help="model hidden sizes to sweep"
    )
    p.add_argument("--layers", type=int, default=None, help="model layers (default: the suite's)")
    p.add_argument(
        "--engines", type=int, default=None, help="rollout engines (default: the suite's)"
    )
    p.add_argument(
        "--learner-ranks", type=int, default=None, help="learner ranks (default: the suite's)"
    )
    p.add_argument(
        "--batch", type=int, default=None, help="prompts per step (default: the suite's)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per sample (default: the suite's)"
    )
    p.add_argument(
        "--headline-eta",
        type=int,
        default=None,
        help="e2e: the η whose ratio to η = 0 is the headline, declared before the runs (2)",
    )
    p.add_argument(
        "--placement",
        choices=["disaggregated", "colocated"],
        default=None,
        help="e2e: colocated runs co-located engines beside disaggregated ones on the same "
        "resources, alternated, and reports the ratio and the switch's share of a step",
    )
    p.add_argument(
        "--elastic",
        action="store_const",
        const=True,
        default=None,
        help="e2e: one engine at the start joined by more mid-run (fleetrl fleet scale) against "
        "the same engines from the start: samples/s after the join and what it cost the others",
    )
    p.add_argument(
        "--regime",
        choices=["demo", "generation-bound", "both"],
        default=None,
        help="vs-trl: the overhead-bound demo, the generation-bound workload, or both (default)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def size_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The size flags the user set (None / empty = the suite's own default)."""
    flags = {name: getattr(args, name, None) for name in SIZE_PARAMETERS}
    if flags.get("hidden") == []:
        flags["hidden"] = None
    if flags.get("device") == "cpu":
        flags["device"] = None  # the parser default: let the suite pick
    return {k: v for k, v in flags.items() if v is not None}


def _wants_sequence(name: str, param: inspect.Parameter | None) -> bool:
    """Whether a suite parameter takes a list of sizes (by annotation, default or plural name)."""
    if param is None:
        return True
    annotation = param.annotation
    text = annotation if isinstance(annotation, str) else str(annotation)
    if any(word in text for word in ("list", "List", "Sequence", "tuple", "Iterable")):
        return True
    if isinstance(param.default, list | tuple) or name.endswith("s"):
        return True
    return annotation is inspect.Parameter.empty and param.default is None


def bind_run_arguments(
    run: Callable[..., Any],
    out_dir: Path,
    quick: bool,
    reps: int | None,
    flags: Mapping[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments for ``run`` from the harness's values; also the flags it cannot take.

    ``reps`` None leaves the suite's own default. A list of hidden sizes goes whole
    to a parameter that takes a sequence, else its first size goes (the rest are
    reported as ignored).
    """
    try:
        params = inspect.signature(run).parameters
    except (TypeError, ValueError) as err:
        raise SuiteUnavailable(f"cannot inspect run(): {err}") from err
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    for name, aliases in (("out_dir", ("out_dir", "out")), ("quick", ("quick",))):
        match = next((a for a in aliases if a in params), None)
        if match is None and not takes_any:
            raise SuiteUnavailable(f"run() takes no {name!r} parameter (has {list(params)})")
        kwargs[match or name] = out_dir if name == "out_dir" else quick
    ignored: list[str] = []
    if reps is not None:
        if "reps" in params or takes_any:
            kwargs["reps"] = reps
        else:
            ignored.append("reps")
    for flag, value in flags.items():
        match = next((a for a in SIZE_PARAMETERS[flag] if a in params), None)
        if match is None and takes_any:
            match = flag
        if match is None:
            ignored.append(flag)
            continue
        if (
            flag == "hidden"
            and isinstance(value, list)
            and not _wants_sequence(match, params.get(match))
        ):
            if len(value) > 1:
                ignored.append(f"hidden[1:]={value[1:]}")
            value = value[0]
        kwargs[match] = value
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and n not in kwargs
    ]
    if missing:
        raise SuiteUnavailable(f"run() requires parameters the harness does not know: {missing}")
    return kwargs, ignored


def _load_run(suite: str) -> Callable[..., Any]:
    module_name = SUITE_MODULES[suite]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SuiteUnavailable(f"cannot import {module_name}: {err}") from err
    run = getattr(module, "run", None)
    if not callable(run):
        raise SuiteUnavailable(f"{module_name} has no run() function")
    return run


def _envelope(
    suite: str,
    returned: Any,
    *,
    config: dict[str, Any],
    started_at: str,
    wall_s: float,
) -> dict[str, Any]:
    """The suite's own dict inside the standard envelope (its own keys win, except status)."""
    if not isinstance(returned, Mapping):
        raise SuiteUnavailable(f"run() returned {type(returned).__name__}, expected a dict")
    results = returned.get("results", {k: v for k, v in returned.items() if k != "summary"})
    record = suite_record(
        suite,
        config={**config, **(returned.get("config") or {})},
        results=results,
        summary=returned.get("summary") or {},
        sweep=returned.get("sweep"),
        started_at=started_at,
        wall_s=wall_s,
    )
    for key, value in returned.items():
        if key not in record or key in ("machine",):
            record[key] = value
    if returned.get("status") == "error" or returned.get("error"):
        record["status"] = "error"
        record["error"] = str(returned.get("error") or "suite reported an error")
    headlines = [key for key, _, _ in report.suite_headlines(suite, record)]
    absent = [k for k in headlines if record["summary"].get(k) is None]
    if absent and record["status"] == "ok":
        record["missing_headlines"] = absent
    return record


def run_suite(
    suite: str, out_dir: Path, *, quick: bool, reps: int | None, flags: Mapping[str, Any]
) -> dict[str, Any]:
    """Run one suite here and write ``DIR/<suite>.json``; a failure becomes an error record."""
    started_at = now_iso()
    t0 = time.monotonic()
    config: dict[str, Any] = {"quick": quick, "reps": reps, "flags": dict(flags)}
    progress = Progress(suite)
    progress.note(f"starting (quick={quick}, reps={reps}, flags={dict(flags)})")
    try:
        run = _load_run(suite)
        kwargs, ignored = bind_run_arguments(run, out_dir, quick, reps, flags)
        config["ignored_flags"] = ignored
        if ignored:
            progress.note(f"flags this suite does not take: {ignored}")
        returned = run(**kwargs)
        record = _envelope(
            suite, returned, config=config, started_at=started_at, wall_s=time.monotonic() - t0
        )
    except SuiteUnavailable as err:
        log.error("bench %s unavailable: %s", suite, err)
        record = suite_record(
            suite,
            config=config,
            error=f"suite unavailable: {err}",
            started_at=started_at,
            wall_s=time.monotonic() - t0,
        )
    except Exception as err:  # service boundary: one suite's failure must not lose the others
        log.exception("bench %s failed", suite)
        record = suite_record(
            suite,
            config=config,
            error=f"suite failed: {type(err).__name__}: {err}",
            started_at=started_at,
            wall_s=time.monotonic() - t0,
        )
    path = write_json(suite_json_path(out_dir, suite), record)
    progress.note(f"{record['status']} in {time.monotonic() - t0:.1f}s -> {path}")
    return record


def _child_command(suite: str, args: argparse.Namespace, reps: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "launcher.cli", "bench", suite, "--out", str(args.out)]
    if reps is not None:
        cmd += ["--reps", str(reps)]
    if args.quick:
        cmd.append("--quick")
    if args.hidden:
        cmd += ["--hidden", *[str(h) for h in args.hidden]]
    flags = ("layers", "engines", "learner_ranks", "batch", "max_new_tokens", "headline_eta")
    for flag in (*flags, "placement", "regime"):
        value = getattr(args, flag, None)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if getattr(args, "elastic", None):
        cmd.append("--elastic")
    cmd += ["--device", str(args.device or "cpu")]
    return cmd


def run_suite_in_child(
    suite: str, args: argparse.Namespace, reps: int | None, timeout_s: float | None
) -> dict[str, Any]:
    """Run one suite in a child process; its JSON (or an error record) is the result."""
    out_dir = Path(args.out)
    path = suite_json_path(out_dir, suite)
    path.unlink(missing_ok=True)
    started_at = now_iso()
    t0 = time.monotonic()
    env = {
        **os.environ,
        CHILD_ENV: "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(_child_command(suite, args, reps), env=env, start_new_session=True)
    error = None
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        error = f"suite timed out after {timeout_s:.0f} s (the --quick deadline) and was stopped"
        end_process_group(proc)
    except KeyboardInterrupt:
        end_process_group(proc)
        raise
    if error is None and path.is_file():
        return read_json(path)
    if error is None:
        error = f"suite process exited with status {proc.returncode} without writing {path.name}"
    log.error("bench %s: %s", suite, error)
    record = suite_record(
        suite,
        config={"quick": bool(args.quick), "reps": reps},
        error=error,
        started_at=started_at,
        wall_s=time.monotonic() - t0,
    )
    write_json(path, record)
    return record


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl bench``."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = bool(args.quick)
    reps = args.reps  # None: each suite's own default for quick / full
    if reps is not None and reps < 1:
        from launcher.cli import UsageError

        raise UsageError(f"--reps must be >= 1, got {reps}")
    suites = list(SUITE_MODULES) if args.suite == "all" else [args.suite]
    records: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    if args.suite == "all":
        slack = 0.0
        for index, suite in enumerate(suites):
            log.info("[bench all] suite %d/%d: %s", index + 1, len(suites), suite)
            timeout = QUICK_BUDGET_S[suite] + slack if quick else None
            started = time.monotonic()
            records[suite] = run_suite_in_child(suite, args, reps, timeout)
            if timeout is not None:
                slack = max(0.0, timeout - (time.monotonic() - started))
    else:
        records[args.suite] = run_suite(
            args.suite, out_dir, quick=quick, reps=reps, flags=size_flags(args)
        )
    failed = [s for s, r in records.items() if r.get("status") != "ok"]
    if os.environ.get(CHILD_ENV) == "1":
        return 1 if failed else 0
    written = report.write_report(out_dir)
    rows = [r for r in report.headline_rows(report.load_records(out_dir)) if r["suite"] in suites]
    for row in rows:
        value = report.fmt(row["value"])
        note = "" if row["status"] == "ok" else f"  ({row['status']})"
        print(f"{row['suite']:>11} {row['ratio']:<18} {value}{note}")
    print(
        f"bench: {len(suites) - len(failed)}/{len(suites)} suites ok in {time.monotonic() - t0:.0f}s;"
        f" table {written['report.md']}"
    )
    return 1 if failed else 0
