"""The elastic CPU demo: the demo run grows from one engine to three while it trains, then
shrinks back to one (``make demo-elastic``).

    .venv/bin/python scripts/demo_elastic.py
    .venv/bin/python scripts/demo_elastic.py --out runs/demo/elastic --grow-at 3 --shrink-at 25

It starts ``fleetrl train --config configs/demo_cpu.yaml rollout.elastic=true
rollout.max_engines=3 trainer.total_steps=100`` (the plain demo otherwise, validation
every 5; 100 steps, not 40: the plain demo's 40 train in about 9 s on two idle cores, and
a joining engine takes about 8 s to start), runs
``fleetrl fleet scale --run OUT --engines 3`` once step ``--grow-at`` is logged and
``fleetrl fleet scale --run OUT --engines 1`` once step ``--shrink-at`` is (and the three
have served ``SERVE_STEPS`` steps: a joining engine's start-up is tens of steps), prints
``fleetrl fleet status`` when each change has taken effect, and at the end a summary: per
phase (one engine, growing, three, back to one) the steps, the engines serving and the
samples/s, the held-out score before and after, the largest staleness, the join and drain
times, and the run's sample account. It writes ``OUT/elastic_demo.json``. Exit status: the
run's (1 if a scale command failed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEETRL = [sys.executable, "-m", "launcher.cli"]
WAIT_S = 900.0
SERVE_STEPS = 3  # steps the three engines serve, at least, before the fleet shrinks
STEPS = 100  # the run's steps: time for two engines to start, serve and leave within it


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def trained(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in records(run_dir) if "actor/pg_loss" in r]


def wait_for(check, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if proc.poll() is not None:
            raise SystemExit(f"demo-elastic: the run ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"demo-elastic: {what} did not happen within {WAIT_S:.0f}s")
        time.sleep(0.5)


def fleet(*args: str, ended: subprocess.Popen | None = None) -> str:
    """``fleetrl fleet ARGS``' output; a failure stops the demo unless the run ``ended`` has
    exited meanwhile (its control file goes with it)."""
    done = subprocess.run([*FLEETRL, "fleet", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        if ended is not None:
            try:
                ended.wait(timeout=120)
                return "demo-elastic: the run ended before `fleetrl fleet status` (one engine)\n"
            except subprocess.TimeoutExpired:
                pass
        raise SystemExit(f"demo-elastic: fleetrl fleet {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def serving(run_dir: Path) -> int:
    rows = trained(run_dir)
    return int(rows[-1].get("fleet/engines", 0)) if rows else 0


def phases(rows: list[dict[str, Any]], grow_at: int, shrink_at: int, per_step: int) -> list[dict]:
    """Steps, engines serving and samples/s of each phase of the run."""
    bounds = [("one engine", 1, grow_at)]
    grown = next((r["step"] for r in rows if r["step"] > grow_at and r.get("fleet/engines") == 3), None)  # fmt: skip
    if grown is not None:
        bounds += [("growing", grow_at + 1, grown), ("three engines", grown + 1, shrink_at)]
    shrunk = next((r["step"] for r in rows if r["step"] > shrink_at and r.get("fleet/engines") == 1), None)  # fmt: skip
    if shrunk is not None:
        bounds += [("shrinking", shrink_at + 1, shrunk), ("back to one", shrunk + 1, rows[-1]["step"])]  # fmt: skip
    clock = {r["step"]: r["time/elapsed_s"] for r in rows}
    clock[0] = rows[0]["time/elapsed_s"] - rows[0]["timing_s/step"]
    out = []
    for name, first, last in bounds:
        if last < first or first - 1 not in clock or last not in clock:
            continue
        wall = clock[last] - clock[first - 1]
        engines = sorted({int(r.get("fleet/engines", 0)) for r in rows if first <= r["step"] <= last})  # fmt: skip
        out.append({
            "phase": name, "steps": [first, last], "engines_serving": engines,
            "samples_per_s": (last - first + 1) * per_step / wall if wall > 0 else None,
        })  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo/elastic", help="the run directory")
    parser.add_argument("--grow-at", type=int, default=3, help="scale to 3 after this step")
    parser.add_argument(
        "--shrink-at", type=int, default=25,
        help=f"back to 1 after this step, and after {SERVE_STEPS} steps with three engines",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="more dotted overrides for the run")
    args = parser.parse_args()
    run_dir = Path(args.out)
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"demo-elastic: {run_dir} holds a run already; remove it or pick --out")
    cmd = [
        *FLEETRL, "train", "--config", "configs/demo_cpu.yaml", f"trainer.output_dir={run_dir}",
        "rollout.elastic=true", "rollout.max_engines=3", f"trainer.total_steps={STEPS}",
        *args.overrides,
    ]  # fmt: skip
    print("$", " ".join(cmd[2:]).replace("launcher.cli", "fleetrl"), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO)
    events: dict[str, Any] = {}
    try:
        wait_for(lambda: len(trained(run_dir)) >= args.grow_at, f"step {args.grow_at}", proc)
        print(fleet("scale", "--run", str(run_dir), "--engines", "3"), end="", flush=True)
        events["grow_sent_at_step"] = trained(run_dir)[-1]["step"]
        wait_for(lambda: serving(run_dir) == 3, "three engines serving", proc)
        print(fleet("status", "--run", str(run_dir)), end="", flush=True)
        # the joining engines' start-up takes seconds, tens of steps on an idle CPU: the
        # three serve a few steps whenever they arrive before the fleet shrinks again
        shrink_at = max(args.shrink_at, trained(run_dir)[-1]["step"] + SERVE_STEPS)
        wait_for(lambda: len(trained(run_dir)) >= shrink_at, f"step {shrink_at}", proc)
        print(fleet("scale", "--run", str(run_dir), "--engines", "1"), end="", flush=True)
        events["shrink_sent_at_step"] = trained(run_dir)[-1]["step"]
        wait_for(lambda: serving(run_dir) == 1 and trained(run_dir)[-1].get("fleet/engines_draining") == 0, "one engine left", proc)  # fmt: skip
        if proc.poll() is None:  # the run may end as the last engine drains: nothing to ask
            print(fleet("status", "--run", str(run_dir), ended=proc), end="", flush=True)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    rows = trained(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    last = rows[-1]
    report = {
        **events,
        "phases": phases(rows, events["grow_sent_at_step"], events["shrink_sent_at_step"], 16 * 8),
        "initial_val_score": summary.get("initial_val_score"),
        "final_val_score": summary.get("final_val_score"),
        "val_scores": summary.get("val_scores"),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "refused_stale": last.get("buffer/refused_stale"),
        "joins": last.get("fleet/joins"),
        "leaves": last.get("fleet/leaves"),
        "join_s_max": last.get("fleet/join_s_max"),
        "drain_s": last.get("fleet/drain_s"),
        "regroup_s": [r["fleet/regroup_s"] for r in rows if "fleet/regroup_s" in r],
        "sample_account": summary.get("sample_account"),
        "train_wall_s": summary.get("train_wall_s"),
    }
    (run_dir / "elastic_demo.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
