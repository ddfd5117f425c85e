"""RL on a reward server started by hand: `fleetrl engine --model RM --port P`, then `fleetrl
train` with `reward.model.urls=[http://127.0.0.1:P]`.

The reward model is a tiny random one with the policy's tokenizer (the tiny models share
one). The run places no reward server of its own (`roles.json` lists none); with
`reward.rule_weight=0` the reward it trains on is the model's score alone. It must finish
(exit 0) with `reward_model/*` counters showing every group scored on that server and
nothing failed, and the server's own request log (`--log-requests`: one line per scored
input) and `/get_server_info` must account for every input the client says it sent. The
server is stopped through its process object (SIGTERM: a clean shutdown, exit 0).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from bench.reward_server import free_port
from fleetrl.models.tiny import make_tiny_model
from tests.e2e.demo_run import demo_train_cmd

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
SERVER_START_TIMEOUT_S = 300.0


def _auth(env: dict[str, str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {env['FLEETRL_API_KEY']}"}


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise AssertionError(
        f"the reward server at {url} did not start: {log_path.read_text()[-3000:]}"
    )


@pytest.mark.timeout(900)
def test_rl_scores_every_group_on_a_reward_server_started_by_hand(tmp_path: Path):
    rm = make_tiny_model(tmp_path / "rm", layers=1, hidden=32, heads=4, max_positions=64, seed=3, reward_model=True)  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the key `fleetrl engine` requires and the run's client sends (reward.model.api_key_env)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["FLEETRL_API_KEY"] = secrets.token_urlsafe(32)
    server_log = tmp_path / "reward_server.log"
    with server_log.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "engine", "--model", str(rm),
             "--port", str(port), "--engine-id", "rm-by-hand", "--log-requests"],
            cwd=REPO, env={**env, "FLEETRL_LOG_LEVEL": "INFO"}, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        _wait_healthy(server, url, server_log)
        run_dir = tmp_path / "run"
        train_log = tmp_path / "train.log"
        cmd = demo_train_cmd(
            tmp_path, run_dir, STEPS,
            f"reward.model.path={rm}", f"reward.model.urls=[{url}]", "reward.rule_weight=0",
        )  # fmt: skip
        with train_log.open("w") as log:
            train = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log, timeout=780)
        assert train.returncode == 0, train_log.read_text()[-3000:]
        info = requests.get(url + "/get_server_info", headers=_auth(env), timeout=30).json()
    finally:
        server.terminate()  # what Ctrl-C in the user's terminal would do: a clean shutdown
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
    assert server.returncode == 0, server_log.read_text()[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]  # fmt: skip
    steps = [r for r in records if "reward_model/items" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), records
    last = steps[-1]
    # every group was scored by the model on that one server, and nothing failed
    assert last["reward_model/servers"] == 1 and last["reward_model/requests"] > 0
    assert last["reward_model/items"] > 0 and last["reward/samples_scored"] > 0
    for r in steps:
        assert r["reward_model/failures"] == 0 and r.get("reward_model/retries", 0) == 0
        assert r["reward/model_failed"] == 0 and r["reward/samples_failed"] == 0
        assert r["reward/model_batches_failed"] == 0
    # the model's scores were used, and alone (rule_weight 0): where a step scored groups,
    # the mean reward is the mean model score
    scored = [r for r in steps if "reward/model_score/mean" in r]
    assert scored, steps
    for r in scored:
        assert r["reward/score/mean"] == pytest.approx(r["reward/model_score/mean"])
    # the run placed no reward server of its own
    roster = json.loads((run_dir / "roles.json").read_text())
    assert not any(name.startswith("reward-") for name in roster), roster
    # the server's side: one log line per input it scored on /classify, as many as its
    # counter, and at least every input the client had sent by the last step
    served = [line for line in server_log.read_text().splitlines() if "rm-by-hand /classify rid=" in line]  # fmt: skip
    assert info["scored_items"] >= len(served) >= last["reward_model/items"]
    assert info["scored_requests"] >= last["reward_model/requests"]
