"""A training run that places a reward fleet: `fleetrl train` with `reward.model.path`.

The CPU demo runs with a tiny reward model and no `reward.model.urls`: the rollout role
places the reward server (an embedded-engine Ray actor on the local instance's `reward`
resource) beside the rollout engine, lists its pid in roles.json, and reports
`reward_fleet/*` and `reward_model/*` metrics. The reward server is killed with SIGKILL
mid-run (its pid from roles.json, never by name): training goes on, the fleet replaces it
and the client's pool holds the replacement again (`reward_model/servers` back to 1); a
SIGINT then stops the run gracefully, exit status 0.

Before the kill, the run's servers are probed as another user of the host would: the
rollout engine and the reward server answer 401 without the run's key (loopback
included) and serve with it, and the key is on no process's command line and in no log.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
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


def _status(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, http.client.HTTPException):  # nothing, or no HTTP, on that port
        return 0


def _server_url(pid: int) -> str:
    """The HTTP server among a process's listening ports (a Ray worker has others)."""
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            url = f"http://127.0.0.1:{conn.laddr.port}"
            if _status(f"{url}/health", None) == 200:  # /health is open, as SGLang's
                return url
    raise AssertionError(f"pid {pid} serves no HTTP /health")


def check_the_servers_require_the_runs_key(run_dir: Path, roster: dict, log_path: Path) -> None:
    key_file = run_dir / "secrets" / "engine_api_key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text().strip()
    servers = [name for name in roster if name.startswith(("engine", "reward"))]
    assert len(servers) == 2, roster  # the rollout engine and the reward server
    for name in servers:
        url = _server_url(roster[name])
        assert _status(f"{url}/model_info", None) == 401, name
        assert _status(f"{url}/model_info", "wrong") == 401, name
        assert _status(f"{url}/model_info", key) == 200, name
    for proc in psutil.process_iter():
        try:
            assert key not in " ".join(proc.cmdline()), f"the key is on pid {proc.pid}'s command line"  # fmt: skip
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    logs = [log_path, *(p for p in run_dir.rglob("*") if p.is_file() and p != key_file)]
    leaked = [str(p) for p in logs if key.encode() in p.read_bytes()]
    assert not leaked, f"the key is written in {leaked}"


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
        check_the_servers_require_the_runs_key(run_dir, roster, log_path)
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
