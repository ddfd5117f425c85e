"""Soak test: run the CPU demo for N minutes; report memory growth and throughput drift per role.

    .venv/bin/python scripts/soak.py                 # 30 minutes (the default)
    .venv/bin/python scripts/soak.py --minutes 3 --out runs/soak_short

It starts ``fleetrl train`` (configs/demo_cpu.yaml unless ``--config``) as a child process
with an effectively endless ``trainer.total_steps``, and every ``--interval-s`` seconds
samples the resident memory (RSS) of each role process named in the run's ``roles.json``
(the driver writes role -> pid from each actor's ``os.getpid()``) and the run's progress
from ``metrics.jsonl``. At the end it stops the run with SIGTERM (the run checkpoints and
exits; SIGKILL of that same child pid after a grace period), then writes
``<out>/soak.json`` (every sample) and ``<out>/soak.md`` (a table per role: RSS at the
first and last sample, growth, growth per hour from a least-squares fit; and learner steps
and samples per second per interval, with the drift of the last third against the first).

A role whose pid changes between samples was restarted (a fault or a replacement): its
series restarts and the report says so. Left out: GPU memory (the CPU demo has none),
open file descriptors, and any pass/fail threshold - the numbers are for a person to judge.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENDLESS_STEPS = 10_000_000
STOP_GRACE_S = 120.0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    parser.add_argument("--interval-s", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--config", default="configs/demo_cpu.yaml")
    parser.add_argument("--out", default="runs/soak", help="report folder (the run goes in run/)")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.interval_s <= 0:
        parser.error("--minutes and --interval-s must be > 0")
    return args


def _rss_mb(pid: int) -> float | None:
    from launcher.supervision import import_psutil

    psutil = import_psutil()
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _progress(metrics_path: Path) -> int:
    """The last learner step logged in metrics.jsonl (0 before the first)."""
    step = 0
    if not metrics_path.exists():
        return step
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if "actor/pg_loss" in record:
            step = max(step, int(record["step"]))
    return step


def _slope_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return (
        0.0
        if var == 0
        else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 3600
    )


def _drift(values: list[float]) -> float | None:
    """Mean of the last third over the mean of the first third, minus one."""
    third = len(values) // 3
    if third < 1:
        return None
    first, last = statistics.fmean(values[:third]), statistics.fmean(values[-third:])
    return None if first == 0 else last / first - 1


def summarize(samples: list[dict[str, Any]], samples_per_step: int) -> dict[str, Any]:
    roles: dict[str, dict[str, Any]] = {}
    for sample in samples:
        for role, info in sample["roles"].items():
            entry = roles.setdefault(role, {"pids": [], "points": []})
            if not entry["pids"] or entry["pids"][-1] != info["pid"]:
                entry["pids"].append(info["pid"])
                entry["points"] = []  # a restarted role: its series starts again
            if info["rss_mb"] is not None:
                entry["points"].append((sample["t"], info["rss_mb"]))
    per_role = {}
    for role, entry in sorted(roles.items()):
        pts = entry["points"]
        per_role[role] = {
            "restarts": len(entry["pids"]) - 1,
            "rss_first_mb": pts[0][1] if pts else None,
            "rss_last_mb": pts[-1][1] if pts else None,
            "growth_mb": pts[-1][1] - pts[0][1] if pts else None,
            "growth_mb_per_hour": _slope_per_hour(pts),
        }
    intervals = []
    for before, after in zip(samples, samples[1:], strict=False):
        dt = after["t"] - before["t"]
        steps = after["step"] - before["step"]
        intervals.append(
            {
                "t_end": after["t"],
                "steps": steps,
                "steps_per_min": steps / dt * 60 if dt > 0 else 0.0,
                "samples_per_s": steps * samples_per_step / dt if dt > 0 else 0.0,
            }
        )
    active = [i["samples_per_s"] for i in intervals if i["steps"] > 0]
    return {
        "roles": per_role,
        "intervals": intervals,
        "throughput_drift": _drift(active),
        "steps": samples[-1]["step"] if samples else 0,
    }


def render_markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"# Soak: {report['minutes']:.1f} minutes of `{report['config']}`",
        "",
        f"{s['steps']} learner steps; run exit status {report['exit_status']}.",
        "",
        "| role | restarts | RSS first (MiB) | RSS last (MiB) | growth (MiB) | growth (MiB/h, fit) |",
        "|---|---|---|---|---|---|",
    ]
    for role, r in s["roles"].items():

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        lines.append(
            f"| {role} | {r['restarts']} | {f(r['rss_first_mb'])} | {f(r['rss_last_mb'])} | "
            f"{f(r['growth_mb'])} | {f(r['growth_mb_per_hour'])} |"
        )
    lines += ["", "| interval end (s) | steps | steps/min | samples/s |", "|---|---|---|---|"]
    for i in s["intervals"]:
        lines.append(
            f"| {i['t_end']:.0f} | {i['steps']} | {i['steps_per_min']:.1f} | "
            f"{i['samples_per_s']:.1f} |"
        )
    drift = s["throughput_drift"]
    lines += [
        "",
        "Throughput drift (last third vs first third of the intervals with progress): "
        + ("n/a (too few intervals)" if drift is None else f"{drift:+.1%}"),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    out = Path(args.out).resolve()
    run_dir = out / "run"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "launcher.cli", "train", "--config", args.config,
        f"trainer.output_dir={run_dir}", f"trainer.total_steps={ENDLESS_STEPS}",
        "trainer.test_freq=-1", "trainer.save_freq=100", *args.overrides,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log_file = open(out / "train.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    from launcher.config import load_run_config

    cfg = load_run_config(REPO / args.config, args.overrides)
    per_step = cfg.data.train_batch_size * cfg.rollout.n
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    deadline = started + args.minutes * 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(min(args.interval_s, max(0.0, deadline - time.monotonic())))
            roster_path = run_dir / "roles.json"
            if not roster_path.exists():
                continue  # still starting
            roster = json.loads(roster_path.read_text())
            step = _progress(run_dir / "metrics.jsonl")
            if step == 0:
                continue  # memory before the first step is start-up, not steady state
            samples.append(
                {
                    "t": time.monotonic() - started,
                    "step": step,
                    "roles": {r: {"pid": p, "rss_mb": _rss_mb(p)} for r, p in roster.items()},
                }
            )
            print(f"[soak] t={samples[-1]['t']:.0f}s step={step}", flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the run checkpoints and stops
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_file.close()
    report = {
        "config": args.config,
        "minutes": (time.monotonic() - started) / 60,
        "interval_s": args.interval_s,
        "exit_status": proc.returncode,
        "samples": samples,
        "summary": summarize(samples, per_step),
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    (out / "soak.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0 if samples else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
