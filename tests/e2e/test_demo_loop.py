"""The CPU demo config end to end on local Ray, as `fleetrl train` runs it, for a few versions.

Proves: trajectories flow from the fleet through the buffer into the learner,
the staleness bound η = 2 holds on every step, every version's weights reach
the engine (verified through /model_info and /get_weights_by_name), metrics.jsonl carries the documented metric
names with step and policy_version, the score curve is drawn, exit status 0.
Then the same command, run again, resumes where the first stopped, and Ctrl-C
(SIGINT to the whole process group, as a terminal sends it) ends it gracefully:
a checkpoint at the step reached, exit status 0. Run once more, it resumes from
that checkpoint and SIGTERM to the driver alone (what ``docker stop``, Kubernetes
and systemd's ``KillMode=mixed`` send) ends it the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REQUIRED_METRICS = [
    "timing_s/step",
    "timing_s/gen",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "critic/score/mean",
    "response_length/mean",
    "perf/throughput",
    "staleness/mean",
    "staleness/max",
    "buffer/size",
    "buffer/refused_stale",
    "timing_s/update_weights",
    "fleet/engines_alive",
    "rollout/idle_fraction",
    "trainer/idle_fraction",
]


def _command(tmp_path: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_cpu.yaml",
        f"trainer.output_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "trainer.test_freq=3",
        "trainer.save_freq=3",
        "buffer.max_staleness=2",
        f"model.path={tmp_path / 'model'}",
        "model.warmstart.steps=30",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
        "data.val_max_samples=32",
    ]  # fmt: skip


ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
REPO = Path(__file__).resolve().parents[2]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(900)
def test_demo_config_runs_async_loop_with_bounded_staleness(tmp_path: Path):
    run_dir = tmp_path / "run"
    steps = 6
    cmd = _command(tmp_path, run_dir, steps)
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]

    records = _records(run_dir)
    train_steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in train_steps] == list(range(1, steps + 1))
    for record in train_steps:
        missing = [k for k in REQUIRED_METRICS if k not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["staleness/max"] <= 2
        assert record["weight_sync/num_failed"] == 0
        assert record["fleet/engines_alive"] == 1
    # one version is published per step (sync_every=1), starting from version 0
    assert [r["policy_version"] for r in train_steps] == list(range(1, steps + 1))
    assert sum(r["perf/response_tokens"] for r in train_steps) > 0
    assert any("val/score/mean" in r for r in records)
    assert (run_dir / "score_curve.png").stat().st_size > 0
    assert (run_dir / "checkpoints" / f"step_{steps}").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples"] == steps * 16 * 8
    assert "held-out score" in proc.stdout

    # the same command again, longer: it resumes at step 6; Ctrl-C then stops it cleanly
    stopped = _resume_then_signal(tmp_path, run_dir, steps, signal.SIGINT, whole_group=True)
    # and once more: it resumes from that checkpoint; SIGTERM to the driver stops it cleanly
    _resume_then_signal(tmp_path, run_dir, stopped, signal.SIGTERM, whole_group=False)


def _resume_then_signal(
    tmp_path: Path, run_dir: Path, resume_step: int, sig: signal.Signals, *, whole_group: bool
) -> int:
    """Run the command again (it resumes at ``resume_step``), send ``sig`` two steps later;
    check a clean stop: exit 0, steps and versions continued, a checkpoint where it stopped.
    Returns the step it stopped at."""
    log_path = tmp_path / f"resume-{sig.name}.log"
    log = log_path.open("w")
    resumed = subprocess.Popen(
        _command(tmp_path, run_dir, 1000), cwd=REPO, env=ENV, stdout=log, stderr=log,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while max((r["step"] for r in _records(run_dir)), default=0) < resume_step + 2:
            assert resumed.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the resumed run made no progress"
            time.sleep(0.5)
        if whole_group:
            os.killpg(resumed.pid, sig)  # what a terminal's Ctrl-C does
        else:
            resumed.send_signal(sig)  # to the driver only, as a service manager does
        assert resumed.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
    later = [r for r in _records(run_dir) if "actor/pg_loss" in r and r["step"] > resume_step]
    assert [r["step"] for r in later] == list(range(resume_step + 1, later[-1]["step"] + 1))
    assert later[0]["policy_version"] == resume_step + 1  # versions continue from the checkpoint
    assert all(r["staleness/max"] <= 2 for r in later)
    assert (run_dir / "checkpoints" / f"step_{later[-1]['step']}").is_dir()
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] == sig.name
    return later[-1]["step"]
