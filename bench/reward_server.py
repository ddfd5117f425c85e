"""A reward server for the reward suites: ``fleetrl engine`` over a reward folder, in a process
of its own on a free loopback port, started and stopped by the suite itself.

Both halves of ``fleetrl bench reward`` score on one: bench/reward.py (batched
``/classify`` against one request per sample) and bench/reward_e2e.py (the model arm
of the RL runs scores on it through ``reward.model.urls``). The process is the
embedded engine's CLI (``python -m rollout_fleet.engine.cli``), as a user starts one
by hand; it is ended through its ``Popen`` object (SIGTERM, then SIGKILL), never by
name. ``info()`` is the server's ``/get_server_info`` (scored requests, items,
forwards), which tells a suite that the server really did the scoring. Like every server
``fleetrl engine`` starts, it requires a key (``api_key``, made here, handed to it in
``FLEETRL_API_KEY``), which the suites' clients send.

Left out: SGLang servers (GPU), several servers behind one URL list.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.common import REPO_ROOT
from rollout_fleet.engine.http_service import API_KEY_ENV

SERVER_START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RewardServer:
    """One reward server process on loopback; a context manager that stops it on exit."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_running_requests: int = 64,
        engine_id: str = "bench-reward",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = secrets.token_urlsafe(32)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "FLEETRL_LOG_LEVEL": "WARNING",
               API_KEY_ENV: self.api_key}  # fmt: skip
        cmd = [sys.executable, "-m", "rollout_fleet.engine.cli", "--model", str(self.model_dir),
               "--port", str(self.port), "--engine-id", engine_id,
               "--max-running-requests", str(max_running_requests)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)

    def wait(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> RewardServer:
        """Block until ``/health`` answers 200; raise if the process exits or time runs out."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the reward server for {self.model_dir} exited with {self.proc.returncode}"
                )
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the reward server at {self.url} did not start in {timeout_s:.0f} s")

    def info(self) -> dict[str, Any]:
        """The server's ``/get_server_info`` (``scored_requests``, ``scored_items``, ``forwards``)."""
        import requests

        headers = {"Authorization": f"Bearer {self.api_key}"}
        return requests.get(self.url + "/get_server_info", headers=headers, timeout=30).json()

    def forwards(self) -> int:
        return int(self.info()["forwards"])

    def stop(self) -> None:
        """SIGTERM (the server shuts down cleanly), SIGKILL after 30 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
