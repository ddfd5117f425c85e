"""A training run that places a reward fleet: `fleetrl train` with `reward.model.path`.

The CPU demo runs with a tiny reward model and no `reward.model.urls`: the rollout role
places the reward server (an embedded-engine Ray actor on the local instance's `reward`
resource) beside the rollout engine, lists its pid in roles.json, and reports
`reward_fleet/*` and `reward_model/*` metrics. The reward server is killed with SIGKILL
mid-run (its pid from roles.json, never by name): training goes on, the fleet replaces it
and the client's pool holds the replacement again (`reward_model/servers` back to 1); a
SIGINT then stops the run gracefully, exit status 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fleetrl.models.tiny import make_tiny_model
from tests.e2e.demo_run import demo_train_cmd

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 200  # more than it will run: the SIGINT ends it once the replacement serves
KILL_AFTER_STEP = 2
REPLACED_WITHIN_S = 300.0


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(900)
def test_run_places_the_reward_fleet_and_replaces_a_killed_reward_server(tmp_path: Path):
    rm = make_tiny_model(tmp_path / "rm", layers=1, hidden=32, heads=4, max_positions=64, seed=3, reward_model=True)  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = demo_train_cmd(
        tmp_path, run_dir, STEPS,
        f"reward.model.path={rm}", "reward.model.cpus_per_engine=0.5",
        "rollout.health_check_interval_s=1", "rollout.health_check_timeout_s=3",
        "rollout.health_failures_before_dead=2",
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log_path = tmp_path / "train.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while max((r.get("step", 0) for r in _records(run_dir)), default=0) < KILL_AFTER_STEP:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"step {KILL_AFTER_STEP} not reached"
            time.sleep(0.5)
        roster = json.loads((run_dir / "roles.json").read_text())
        assert "reward-0" in roster, roster  # the placed reward server, by its pid
        first = roster["reward-0"]
        os.kill(first, signal.SIGKILL)
        killed_at = max(r["step"] for r in _records(run_dir))
        deadline = time.monotonic() + REPLACED_WITHIN_S
        while not any(
            r["step"] > killed_at and r.get("reward_fleet/engine_restarts", 0) >= 1
            and r.get("reward_fleet/engines_alive") == 1 and r.get("reward_model/servers") == 1
            for r in _records(run_dir)
        ):  # fmt: skip
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the reward server was not replaced"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(timeout=180) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    records = _records(run_dir)
    assert all(r.get("reward_model/failures", 0) == 0 for r in records)
    assert [r["step"] for r in records] == list(range(1, records[-1]["step"] + 1))  # no step lost
    assert not _alive(first)
