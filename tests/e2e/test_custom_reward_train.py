"""Your own reward function, end to end: `fleetrl train` on the CPU demo config with
``reward.custom_function.path`` naming a file outside the package.

The file (written to the test's temporary folder) scores the demo's addition task by
the sum itself, tags every score with a marker from ``reward_kwargs``, and raises on
every wrong response holding a "7" (the right answer it scores, as preflight's trial of
the function on the first rows' ground truths checks). Proves: the user's function scores every sample the run
trains on (the marker is on every scored row of the rollout bank), a sample it raised
on is kept with its group, marked, and trains nothing, the failures are counted in
metrics.jsonl, validation reports the rule score, and the run exits 0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
MY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, marker=0.0):
    answer = solution_str.strip()
    if "7" in solution_str and answer != ground_truth:
        raise ValueError("no sevens")
    return {"score": float(answer == ground_truth), "marker": marker}
"""


def bank_rows(bank: Path) -> list[dict]:
    rows = []
    for segment in sorted(bank.glob("segment_*.arrow")):
        with pa.OSFile(str(segment), "rb") as f:
            table = pa.ipc.open_stream(f).read_all()
        rows += table.select(["uid", "reward_error", "reward_metrics"]).to_pylist()
    return rows


@pytest.mark.timeout(900)
def test_a_run_scores_with_a_reward_function_from_the_users_file(tmp_path: Path):
    reward_file = tmp_path / "elsewhere" / "my_reward.py"
    reward_file.parent.mkdir()
    reward_file.write_text(MY_REWARD)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_cpu.yaml",
        f"trainer.output_dir={run_dir}", f"trainer.total_steps={STEPS}",
        "trainer.test_freq=3", "trainer.save_freq=-1", "data.train_batch_size=8",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]", "data.val_max_samples=16",
        f"model.path={tmp_path / 'model'}", "model.warmstart.steps=30",
        f"reward.custom_function.path={reward_file}",
        "reward.custom_function.reward_kwargs={marker: 7.5}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = bank_rows(run_dir / "rollout_bank")
    assert rows, "the rollout bank holds no trajectories"
    scored = [r for r in rows if not r["reward_error"]]
    failed = [r for r in rows if r["reward_error"]]
    assert scored, "no sample was scored"
    assert failed, "no response held a 7: the failure path went unexercised"
    # the user's function scored every row its data_source has: its marker is on each
    assert all(dict(r["reward_metrics"]).get("marker") == 7.5 for r in scored)
    assert all("rule: raised ValueError('no sevens')" in r["reward_error"] for r in failed)
    assert all("marker" not in dict(r["reward_metrics"]) for r in failed)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == STEPS
    for row in steps:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    last = records[-1]
    # every failure is counted: the bank's marked rows plus the samples of dropped groups
    assert last["reward/samples_failed"] >= len(failed)
    assert last["reward/samples_scored"] >= len(rows)
    trained_failed = sum(r["reward/failed_in_batch"] for r in steps)
    assert trained_failed <= len(failed)
    assert "val/rule_score/mean" in last and "val/score/synth/add2" in last
