"""Start the vLLM harness (``harness.py``) on the command line fleetrl's launcher builds.

``start_vllm_engine(model_dir, tp_size=1, key=KEY, **spec)`` builds a ``VllmServerSpec``,
its ``vllm serve`` argv (``build_command``) and environment (``server_env``: the key in
``VLLM_API_KEY``, dev mode), and runs the harness with ``.venv/vllm-overlay`` first on its
path; it returns once vLLM's app answers. ``VllmEngine.stop`` ends the harness's process
group by its own pid. ``OVERLAY`` is where ``make venv`` puts what vLLM needs beside the venv.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from rollout_fleet.sglang_launcher import free_port
from rollout_fleet.vllm_launcher import (
    VllmServerSpec,
    build_command,
    server_env,
    set_initial_version,
)

KEY = "vllm-conformance-key"
OVERLAY = Path(sys.prefix) / "vllm-overlay"
REPO = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 240.0


@dataclass
class VllmEngine:
    url: str
    key: str
    tp_size: int
    proc: subprocess.Popen
    argv: list[str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def get(self, path: str) -> dict:
        response = requests.get(self.url + path, headers=self.headers, timeout=60)
        response.raise_for_status()
        return response.json()

    def rank_weights(self) -> list[dict[str, list[float]]]:
        return requests.get(self.url + "/harness/weights", headers=self.headers, timeout=120).json()  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(20)


def harness_env(spec: VllmServerSpec) -> dict[str, str]:
    env = {**os.environ, **server_env(spec, base={})}
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), str(REPO)])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_vllm_engine(
    model_dir: Path, tp_size: int = 1, key: str = KEY, **spec_fields
) -> VllmEngine:
    spec = VllmServerSpec(
        model_path=str(model_dir), api_key=key, port=free_port(), tp_size=tp_size,
        dtype="float32", **spec_fields,
    )  # fmt: skip
    argv = build_command(spec)
    ready = Path(tempfile.mkdtemp(prefix="vllm-harness-")) / "ready.json"
    serve_argv = argv[argv.index("serve") :]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.conformance.vllm.harness", str(ready), "--", *serve_argv],
        env=harness_env(spec), cwd=REPO, start_new_session=True,
    )  # fmt: skip
    engine = VllmEngine(f"http://127.0.0.1:{spec.port}", key, tp_size, proc, argv)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM harness exited with status {proc.returncode}")
        if ready.exists():
            with contextlib.suppress(requests.RequestException):
                if requests.get(engine.url + "/health", headers=engine.headers, timeout=5).ok:
                    set_initial_version(engine.url, key)  # as VllmServer does once healthy
                    return engine
        time.sleep(0.5)
    engine.stop()
    raise TimeoutError(f"the vLLM harness did not answer within {STARTUP_TIMEOUT_S:.0f} s")
