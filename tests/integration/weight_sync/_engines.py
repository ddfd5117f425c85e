"""Start and stop reference engines (``weight_sync.reference_engine``) as subprocesses for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[3]


class EngineProcess:
    """One reference engine subprocess; ``url`` once it serves."""

    def __init__(self, args: list[str], workdir: Path, name: str) -> None:
        self.name = name
        self.port_file = workdir / f"{name}.port"
        self.log_path = workdir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weight_sync.reference_engine",
                *args,
                "--port",
                "0",
                "--port-file",
                str(self.port_file),
            ],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.url = ""

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited: {self.log_path.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} did not start: {self.log_path.read_text()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port_file.read_text().strip()}"
        requests.get(self.url + "/health", timeout=10).raise_for_status()
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by the pid we started
        self.proc.wait(timeout=10)
        self._log.close()


@contextmanager
def reference_engines(specs: dict[str, list[str]], workdir: Path):
    """Start engines named by ``specs`` (name -> extra CLI args) in parallel; stop them all on exit."""
    engines = {name: EngineProcess(args, workdir, name) for name, args in specs.items()}
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()
