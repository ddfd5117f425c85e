"""A reward that fails on everything stops the run by itself, with the error in one line.

The user's function scores an exact match and raises on anything else: preflight, which
calls it with each row's ground truth, lets it through, and in the run, on a random-init
policy that never writes a bare sum, it raises on every sample. `fleetrl train` must stop
on its own once `reward.max_failed_groups` groups in a row failed whole: exit status 1,
one line quoting the function's error, a checkpoint to resume from once the function is
fixed, and no Ray token-authentication warning on the way.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from learner.checkpoint import latest_complete_checkpoint
from tests.e2e.demo_run import demo_train_cmd

REPO = Path(__file__).resolve().parents[2]
PICKY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str != ground_truth:
        raise ValueError(f"cannot parse {solution_str!r}")
    return 1.0
"""
LIMIT = 24

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_a_run_whose_reward_always_fails_stops_by_itself_with_the_error(tmp_path: Path):
    reward = tmp_path / "picky_reward.py"
    reward.write_text(PICKY_REWARD)
    run_dir = tmp_path / "run"
    cmd = demo_train_cmd(
        tmp_path, run_dir, 40, "model.warmstart.steps=0", "data.train_batch_size=4",
        "trainer.resume=auto", f"reward.custom_function.path={reward}",
        f"reward.max_failed_groups={LIMIT}",
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 1, proc.stderr[-4000:]
    stopped = [line for line in proc.stderr.splitlines() if "training stopped:" in line]
    assert len(stopped) == 1, proc.stderr[-4000:]
    # the streak the driver saw when it looked: at least the limit
    streak = re.search(r"the reward failed on every sample of (\d+) groups in a row", stopped[0])
    assert streak is not None and int(streak.group(1)) >= LIMIT, stopped[0]
    assert f"(reward.max_failed_groups={LIMIT}); the last error: rule: raised ValueError(" in stopped[0]  # fmt: skip
    assert "fix the reward, then rerun" in stopped[0]
    newest = latest_complete_checkpoint(run_dir / "checkpoints")
    assert newest is not None and newest.name == "step_0"
    assert "Token authentication" not in proc.stderr + proc.stdout
