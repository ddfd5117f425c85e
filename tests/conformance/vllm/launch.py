"""Start the vLLM harness (``harness.py``) on the command line fleetrl's launcher builds.

``launch_vllm_engine(model_dir, tp_size=1, key=KEY, **spec)`` builds a ``VllmServerSpec``,
its ``vllm serve`` argv (``build_command``) and environment (``server_env``: the key in
``VLLM_API_KEY``, dev mode), and starts the harness with ``.venv/vllm-overlay`` first on its
path; ``VllmEngine.wait_ready`` returns once vLLM's app answers. ``gpu_check_server`` is
the GPU check's vLLM server on a CPU (``bench.gpu.vllm_stages``). ``VllmEngine.stop`` ends the harness's process
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
from rollout_fleet.vllm_client import request_name
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
    ready_file: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def get(self, path: str) -> dict:
        response = requests.get(self.url + path, headers=self.headers, timeout=60)
        response.raise_for_status()
        return response.json()

    def post(self, path: str) -> dict:
        response = requests.post(self.url + path, headers=self.headers, timeout=60)
        response.raise_for_status()
        return response.json()

    def wait_held(self, rid: str, timeout_s: float = 120.0) -> None:
        """Until request ``rid`` waits at the harness's gate (``POST /harness/hold``)."""
        deadline = time.monotonic() + timeout_s
        while request_name(rid) not in self.get("/harness/held")["held"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} did not reach the harness's gate")
            time.sleep(0.05)

    def rank_weights(self) -> list[dict[str, list[float]]]:
        return requests.get(self.url + "/harness/weights", headers=self.headers, timeout=120).json()  # fmt: skip

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until vLLM's app answers; then version 0, as ``VllmServer`` sets once healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM harness exited with status {self.proc.returncode}")
            if self.ready_file.exists():
                with contextlib.suppress(requests.RequestException):
                    if requests.get(self.url + "/health", headers=self.headers, timeout=5).ok:
                        set_initial_version(self.url, self.key)
                        return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the vLLM harness did not answer within {timeout_s:.0f} s")

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


def launch_vllm_engine(
    model_dir: Path, tp_size: int = 1, key: str = KEY, **spec_fields
) -> VllmEngine:
    """Start the harness; ``VllmEngine.wait_ready`` waits for it (engines start side by side)."""
    spec = VllmServerSpec(
        model_path=str(model_dir), api_key=key, port=free_port(), tp_size=tp_size,
        dtype="float32", **spec_fields,
    )  # fmt: skip
    return launch_spec(spec)


def gpu_check_server(spec: VllmServerSpec, work: Path) -> VllmEngine:
    """The GPU check's vLLM server on a CPU (``scripts/gpu_check.py --device cpu --vllm-server
    tests.conformance.vllm.launch:gpu_check_server``): the harness on ``spec``'s command line."""
    engine = launch_spec(spec)
    engine.wait_ready()
    return engine


def launch_spec(spec: VllmServerSpec) -> VllmEngine:
    """Start the harness on the command line and environment ``spec`` gives."""
    argv = build_command(spec)
    ready = Path(tempfile.mkdtemp(prefix="vllm-harness-")) / "ready.json"
    serve_argv = argv[argv.index("serve") :]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.conformance.vllm.harness", str(ready), "--", *serve_argv],
        env=harness_env(spec), cwd=REPO, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{spec.port}"
    return VllmEngine(url, spec.api_key, spec.tp_size, proc, argv, ready)
