"""A reward server killed mid-run: its batches are rescored elsewhere, nothing lost, nothing twice.

Three real reward servers (``python -m rollout_fleet.engine.cli --model RM --log-requests``,
each its own process on loopback) score a burst of groups through one
``RewardModelClient``; the slowest one (``--max-running-requests 1``: one request per
forward, so work waits in it) is killed with SIGKILL by its pid once it has received
requests. The servers' own request logs count the requests per input:

- every input gets exactly its model score back (0 lost, each equal to the score one
  server gives it alone);
- the survivors received every input at most once (0 scored twice), and every input
  reached a server (the ones only the killed server received it answered before dying);
- the killed server held inputs when it died, and those were rescored on a survivor
  (the failover happened), counted in ``reward_model/failovers``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from rollout_fleet.engine.score_runner import ScoreRunner
from rollout_fleet.rewards.model_client import RewardModelClient

GROUPS, GROUP_SIZE = 24, 8
RID_LINE = re.compile(r"/classify rid=rm-(\w+)-(\d+)-(\d+) prompt_tokens=(\d+)")
REPO = Path(__file__).resolve().parents[3]
KEY = secrets.token_urlsafe(32)  # what `fleetrl engine` requires, loopback included


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, name: str, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "rollout_fleet.engine.cli", "--model", str(model_dir),
           "--port", str(port), "--engine-id", name, "--log-requests", *extra]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FLEETRL_LOG_LEVEL": "INFO",
        "FLEETRL_API_KEY": KEY,
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stderr=log, stdout=log, env=env, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(procs: dict[str, tuple[subprocess.Popen, str]], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    for name, (proc, url) in procs.items():
        while True:
            assert proc.poll() is None, f"{name} exited with {proc.returncode} at start"
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"{name} not healthy in {timeout_s}s"
            time.sleep(0.2)


def received(log_path: Path) -> list[tuple[str, int]]:
    """(batch id, index) of every input the server's log says it received, in order."""
    return [(m[1], int(m[2])) for m in RID_LINE.finditer(log_path.read_text(errors="replace"))]


@pytest.mark.slow  # three server processes (torch import each) on 2 shared cores: ~40-100 s
def test_killed_server_batches_are_rescored_elsewhere_none_lost_none_twice(tiny_reward_dir, tmp_path):  # fmt: skip
    groups = [
        [[(g * 7 + i * 3 + k) % 60 + 7 for k in range(5 + (g + i) % 9)] for i in range(GROUP_SIZE)]
        for g in range(GROUPS)
    ]
    reference = ScoreRunner(tiny_reward_dir)
    expected = [[row[0] for row in reference.score(group)] for group in groups]
    logs = {name: tmp_path / f"{name}.log" for name in ("doomed", "left", "right")}
    procs = {
        "doomed": start_server(
            tiny_reward_dir, "doomed", logs["doomed"], "--max-running-requests", "1"
        ),  # fmt: skip
        "left": start_server(tiny_reward_dir, "left", logs["left"]),
        "right": start_server(tiny_reward_dir, "right", logs["right"]),
    }
    try:
        wait_healthy(procs)
        doomed = procs["doomed"][0]

        async def run():
            client = RewardModelClient(
                {name: url for name, (_, url) in procs.items()},
                api_key=KEY,
                batch_size=4,
                request_timeout_s=30.0,
                max_attempts=4,
                retry_backoff_s=0.05,
            )

            async def kill_when_busy() -> None:
                while len(received(logs["doomed"])) < 8:
                    await asyncio.sleep(0.01)
                doomed.send_signal(signal.SIGKILL)

            killer = asyncio.ensure_future(kill_when_busy())
            try:
                scores = await asyncio.gather(*(client.score(g) for g in groups))
                await asyncio.wait_for(killer, 10)
                return scores, client.stats()
            finally:
                await client.aclose()

        scores, stats = asyncio.run(run())
        doomed.wait(10)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)

    assert doomed.returncode == -signal.SIGKILL
    for got, want in zip(scores, expected, strict=True):  # 0 lost, each its own score
        assert got == pytest.approx(want, abs=1e-5)
    survivors = collections.Counter(received(logs["left"]) + received(logs["right"]))
    at_doomed = set(received(logs["doomed"]))
    assert survivors and max(survivors.values()) == 1  # 0 scored twice by the servers that lived
    inputs = GROUPS * GROUP_SIZE
    assert len(set(survivors) | at_doomed) == inputs  # every input reached a server
    rescored = at_doomed & set(survivors)
    assert rescored  # the killed server held inputs when it died, and they were scored again
    assert stats["reward_model/failovers"] >= 1 and stats["reward_model/failures"] == 0
    assert stats["reward_model/items"] == inputs
