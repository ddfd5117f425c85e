"""Stage ``demo``: 5 steps of ``fleetrl train`` on the device, through Ray.

``python -m launcher.cli train --config configs/demo_cuda.yaml`` (the one-GPU demo: the
learner in bf16 and one embedded engine in bf16 sharing the device, weights over gloo) for
5 steps with a validation at step 5, in a process of its own, as a user runs it: preflight,
a local Ray instance placing the learner group and the engine, the buffer, the weight sync
and the loop. The model and data are built into the stage's folder. On CPU the same config
runs with the device keys turned to the CPU and the sizes shrunk (``SIZES``).

Figures: steps trained, policy losses, seconds per step, tokens per step, samples/s, the learner's
measured peak memory beside its planned ``plan/learner_gb``, the held-out score, the exit
status. It passes when the run exits 0 after 5 steps with finite losses.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import end_process_group
from bench.gpu.stage import CheckFailed, StageContext

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo_cuda.yaml"
STEPS = 5
SIZES: dict[str, list[str]] = {
    "cuda": ["ray.num_gpus=1"],  # declared: a local instance need not detect the device
    "cpu": [
        "trainer.device=cpu", "learner.gpus_per_rank=0", "rollout.gpus_per_engine=0",
        "learner.mixed_precision=auto", "model.dtype=float32", "model.tiny.layers=2",
        "model.tiny.hidden=64", "model.warmstart.steps=40", "model.warmstart.batch_size=16",
        "data.train_batch_size=4", "rollout.n=4", "rollout.max_concurrent_groups=16",
        "rollout.max_running_requests=64", "data.synth_train_size=200",
        "data.synth_test_size=20",
    ],
}  # fmt: skip


def overrides(work: Path, device: str) -> list[str]:
    """The stage's dotted overrides of configs/demo_cuda.yaml (paths in ``work``)."""
    return [
        f"trainer.output_dir={work / 'run'}",
        f"trainer.total_steps={STEPS}",
        f"trainer.test_freq={STEPS}",
        "trainer.save_freq=-1",
        "trainer.resume=disable",
        f"model.path={work / 'model'}",
        f"data.train_files=[{work / 'data' / 'train.parquet'}]",
        f"data.val_files=[{work / 'data' / 'test.parquet'}]",
        "logging.wandb=false",
        *SIZES[device],
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def metrics_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, losses, timings, memory and scores from a run's metrics.jsonl rows."""
    steps = [r for r in rows if "actor/pg_loss" in r]
    step_s = [float(r["timing_s/step"]) for r in steps if "timing_s/step" in r]
    scores = [r["val/score/mean"] for r in rows if "val/score/mean" in r]
    peaks = [r["perf/peak_memory_gb"] for r in steps if "perf/peak_memory_gb" in r]
    plans = [r["plan/learner_gb"] for r in steps if "plan/learner_gb" in r]
    return {
        "steps": len(steps),
        "pg_losses": [r["actor/pg_loss"] for r in steps],
        "step_s": step_s,
        "step_s_median": _median(step_s),
        "tokens_per_step": steps[-1].get("perf/total_num_tokens") if steps else None,
        "samples_per_s": _median(
            [r["perf/samples_per_s"] for r in steps if "perf/samples_per_s" in r]
        ),
        "val_scores": scores,
        "peak_gib": max(peaks) if peaks else None,
        "plan_learner_gib": plans[-1] if plans else None,
    }


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a killed run
    return rows


def train_demo(work: Path, device: str, seconds: float, extra: list[str],
               figures: dict[str, Any]) -> None:  # fmt: skip
    """Run the demo for ``STEPS`` steps (``extra``: more overrides) within ``seconds``; its
    figures into ``figures``; ``CheckFailed`` unless it exits 0 after ``STEPS`` finite steps."""
    cmd = [sys.executable, "-m", "launcher.cli", "train", "--config", str(CONFIG),
           *overrides(work, device), *extra]  # fmt: skip
    figures["command"] = " ".join(cmd[1:])
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "run", ignore_errors=True)  # metrics.jsonl appends: start afresh
    t0 = time.monotonic()
    with open(work / "train.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                end_process_group(proc, grace_s=20.0)  # the run's own session, by its id
    figures.update(metrics_figures(read_rows(work / "run" / "metrics.jsonl")))
    figures.update(exit_code=code, wall_s=round(time.monotonic() - t0, 1))
    tail = (work / "train.log").read_text(errors="replace").strip().splitlines()[-1:]
    if code is None:
        raise CheckFailed(f"fleetrl train did not finish {STEPS} steps in {seconds:.0f} s")
    if code != 0:
        raise CheckFailed(f"fleetrl train exited with status {code}: {''.join(tail)}")
    if figures["steps"] != STEPS:
        raise CheckFailed(f"fleetrl train logged {figures['steps']} steps, not {STEPS}")
    if not all(math.isfinite(x) for x in figures["pg_losses"]):
        raise CheckFailed(f"a policy loss is not finite: {figures['pg_losses']}")


def run(ctx: StageContext) -> None:
    train_demo(ctx.work, ctx.device, ctx.seconds_left(), [], ctx.figures)
