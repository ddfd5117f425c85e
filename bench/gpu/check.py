"""The GPU check's driver: run the planned stages, each in its own time-boxed process, within
one time budget, and write the report.

    python scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--work DIR] [--budget-s S]
                                [--stages a,b] [--skip a,b] [--colocated-push MODULE:FUNCTION]
                                [--vllm-server MODULE:FUNCTION]

The driver itself never touches the device (each stage starts with its memory free). A
stage gets ``min(its limit, what is left of the budget)``; one that would get less than
its ``min_s`` is skipped as out of time, so the whole check ends within ``--budget-s``.
The SGLang and vLLM stages are skipped with one line where their server or a GPU is missing.

Writes few, small files into ``--out`` (on the GPU machine, one H200 without a package
registry as docs/gpu_check.md describes, a remote run's ``$OUT``): ``gpu_check.json``
(``bench.gpu.report``: every stage with status, why, seconds and figures, a summary of
the headline figures, the machine) and ``gpu_check.log`` (the tail of every stage's log);
each stage's full log and scratch files stay in ``--work``. Exit status: 0 no stage
failed, 1 a stage failed, 2 no CUDA device for ``--device cuda`` (one line).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.common import end_process_group
from bench.gpu.import_guard import guard_env
from bench.gpu.plan import MULTI_STAGES, STAGES, headlines
from bench.gpu.report import (
    LOG_NAME,
    StageResult,
    first_line,
    overall,
    render_table,
    write_report,
)
from bench.gpu.stage import INTERRUPTED, StageSpec, read_results

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET_S = {"cuda": 520.0, "cpu": 2400.0}  # cuda: one 10-minute device command
LOG_TAIL_LINES = 150
TERM_GRACE_S = 15.0
GUARD_LOG_NAME = "import_guard.log"
FINAL = ("ok", "failed", "skipped")  # a result a stage wrote when it ended


def _tail(path: Path, lines: int) -> list[str]:
    if not path.is_file():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


def run_stage_process(
    spec: StageSpec,
    *,
    device: str,
    work: Path,
    limit_s: float,
    options: dict[str, str],
    expected: tuple[str, ...] = (),
    guard_log: Path | None = None,
) -> list[StageResult]:
    """Run one stage in a child process of its own session; its results, never raising.

    ``expected``: the names it reports (default its own); one it never reported failed.
    ``guard_log``: run it under ``bench.gpu.import_guard``, refusals written there."""
    expected = expected or (spec.name,)
    stage_work = work / spec.name
    stage_work.mkdir(parents=True, exist_ok=True)
    result_path, log_path = stage_work / "result.json", stage_work / "stage.log"
    result_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "bench.gpu.stage", spec.name, "--module", spec.module,
        "--device", device, "--work", str(stage_work), "--seconds", f"{limit_s:.0f}",
        "--result", str(result_path),
        *(arg for key, value in options.items() for arg in ("--option", f"{key}={value}")),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if guard_log is not None:
        env = guard_env(env, guard_log)
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            end_process_group(proc, TERM_GRACE_S)
            code = proc.returncode
    last = first_line("\n".join(_tail(log_path, 1)))
    why = (
        f"over its {limit_s:.0f} s limit"
        if timed_out
        else f"the stage process exited with status {code} before reporting: {last}"
    )
    # what finished keeps its status; what was still running, or never started, failed
    results = [
        r
        if r.status in FINAL and r.why != INTERRUPTED
        else StageResult(r.name, "failed", why, figures=r.figures)
        for r in read_results(result_path)
    ]
    reported = {r.name for r in results}
    results += [StageResult(name, "failed", why) for name in expected if name not in reported]
    elapsed = round(time.monotonic() - started, 2)
    for r in results:
        r.seconds = r.seconds or elapsed
        r.limit_s = limit_s
    return results


def summary(results: list[StageResult]) -> dict[str, Any]:
    """Every stage's headline figures (``plan.headlines``), and the learner's achieved
    TFLOP/s over the matrix product the machine stage measured on the same device."""
    keys = headlines()
    out: dict[str, Any] = {}
    for r in results:
        for key in keys.get(r.name, ()):
            if r.figures.get(key) is not None:
                out[f"{r.name}.{key}"] = r.figures[key]
    by_name = {r.name: r.figures for r in results}
    measured = by_name.get("machine", {}).get("matmul_tflops")
    for arm in ("packed", "padded"):
        achieved = by_name.get("learner", {}).get(f"tflops_{arm}")
        if measured and achieved:
            out[f"learner.mfu_vs_measured_matmul_{arm}"] = achieved / measured
    return out


def _skipped(names: tuple[str, ...] | list[str], why: str) -> list[StageResult]:
    return [StageResult(name, "skipped", why) for name in names]


def run_check(
    args: argparse.Namespace, stages: Mapping[str, StageSpec] | None = None
) -> list[StageResult]:
    """Every chosen stage of ``stages`` (default ``plan.STAGES``) in order, within the
    budget; their results."""
    stages = STAGES if stages is None else stages
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in args.stages.split(",") if s] if args.stages else list(stages)
    unknown = sorted(set(chosen) | set(args.skip.split(",") if args.skip else []))
    unknown = [name for name in unknown if name and name not in stages]
    if unknown:
        raise SystemExit(f"gpu-check: unknown stage(s) {unknown}; known: {list(stages)}")
    skipped_by_flag = set(args.skip.split(",")) if args.skip else set()
    options = {key: value for key, value in (("colocated_push", args.colocated_push),
                                             ("vllm_server", args.vllm_server)) if value}  # fmt: skip
    budget = args.budget_s or DEFAULT_BUDGET_S[args.device]
    started = time.monotonic()
    results: list[StageResult] = []
    log_path = out / LOG_NAME
    log_path.write_text("")
    for name, spec in stages.items():
        if name not in chosen or name in skipped_by_flag:
            continue
        names, skip_reason = MULTI_STAGES.get(name, ((name,), lambda device, options: None))
        if reason := skip_reason(args.device, options):
            results += _skipped(names, reason)
            print(f"[gpu-check] {name} stages: skipped ({reason})", flush=True)
            continue
        left = budget - (time.monotonic() - started)
        limit = min(spec.limit_s[args.device], left)
        if limit < spec.min_s:
            why = f"the time budget is spent ({left:.0f} s left of {budget:.0f} s)"
            results += _skipped([name], why)
            print(f"[gpu-check] {name}: skipped ({why})", flush=True)
            continue
        print(f"[gpu-check] {name}: running (limit {limit:.0f} s) - {spec.doc}", flush=True)
        stage_results = run_stage_process(
            spec, device=args.device, work=work, limit_s=limit, options=options,
            expected=names,
            guard_log=work / GUARD_LOG_NAME if args.import_guard else None,
        )  # fmt: skip
        results += stage_results
        with open(log_path, "a") as log:
            log.write(
                f"==== {name}: the last {LOG_TAIL_LINES} lines of {work / name / 'stage.log'}\n"
            )
            log.write("\n".join(_tail(work / name / "stage.log", LOG_TAIL_LINES)) + "\n")
        for r in stage_results:
            print(f"[gpu-check] {r.name}: {r.status} ({r.seconds:.1f} s) {r.why}", flush=True)
    return results


def refused_imports(log_path: Path) -> dict[str, Any]:
    """What the import guard refused: each module once, with the places that asked for it."""
    refused: dict[str, set[str]] = {}
    for line in log_path.read_text().splitlines() if log_path.is_file() else []:
        parts = line.split(" ", 3)
        if len(parts) >= 3:
            refused.setdefault(parts[1], set()).add(parts[2])
    return {
        "on": True,
        "refused": {module: sorted(callers) for module, callers in sorted(refused.items())},
    }


def machine_facts() -> dict[str, Any]:
    """What the driver knows without touching the device (the machine stage adds the rest)."""
    from bench.common import machine_info

    facts = machine_info()
    manifest = REPO / ".device-bundle" / "manifest.json"
    if manifest.is_file():
        import json

        data = json.loads(manifest.read_text())
        facts["device_bundle"] = {
            "packages": {p["name"]: p["version"] for p in data.get("packages", [])},
            "tree_commit": data.get("tree_commit"),
        }
    return facts


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--work", default="runs/gpu_check_work")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for every stage together (default {DEFAULT_BUDGET_S})",
    )
    parser.add_argument("--stages", default="", help=f"comma-separated, of {list(STAGES)}")
    parser.add_argument("--skip", default="", help="comma-separated stages not to run")
    parser.add_argument(
        "--import-guard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse what the GPU machine lacks (bench.gpu.import_guard; "
        "default: on with --device cpu)",
    )
    parser.add_argument(
        "--colocated-push",
        default="",
        help="MODULE:FUNCTION pushing weights over the co-located path "
        "(bench.gpu.weight_sync.ColocatedPush)",
    )
    parser.add_argument("--vllm-server", default="",
                        help="MODULE:FUNCTION starting the vLLM stages' server from its "
                             "VllmServerSpec (bench.gpu.vllm_stages); on a CPU they need one")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.import_guard is None:
        args.import_guard = args.device == "cpu"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device visible (--device cpu runs every stage on the CPU)")
            return 2
    Path(args.work).mkdir(parents=True, exist_ok=True)
    (Path(args.work) / GUARD_LOG_NAME).unlink(missing_ok=True)
    results = run_check(args)
    machine = machine_facts()
    if args.import_guard:
        machine["import_guard"] = refused_imports(Path(args.work) / GUARD_LOG_NAME)
    path = write_report(Path(args.out), results, machine=machine, config=vars(args),
                        summary=summary(results))  # fmt: skip
    print(render_table(results, headlines()))
    print(f"report: {path}")
    return 0 if overall(results) else 1
