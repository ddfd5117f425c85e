"""The import guard (bench.gpu.import_guard) makes a process here refuse what the GPU machine
(one H200, Python 3.12, torch 2.11, no package registry; docs/gpu_check.md) lacks, as it would
fail there, while the machine's and the bundle's packages load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.gpu.import_guard import denied_modules, guard_env

REPO = Path(__file__).resolve().parents[4]


def run_guarded(code: str, log: Path) -> subprocess.CompletedProcess:
    env = guard_env({**os.environ, "PYTHONPATH": str(REPO)}, log)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_what_the_machine_lacks_is_denied_and_what_it_has_or_the_bundle_carries_is_not():
    denied, machine = denied_modules()
    assert {"wandb", "fastapi", "pydantic", "uvicorn", "sglang", "starlette"} <= set(denied)
    assert not {"torch", "transformers", "numpy", "pyarrow", "msgspec", "zmq", "ray",
                "jsonschema", "fleetrl", "bench", "learner"} & set(denied)  # fmt: skip
    assert {"torch", "transformers", "yaml", "requests"} <= set(machine)


def test_a_missing_package_is_absent_as_on_the_machine_and_each_ask_is_logged(tmp_path):
    log = tmp_path / "guard.log"
    code = (
        "import importlib.util\n"
        "import msgspec, zmq, torch, huggingface_hub\n"  # the bundle's and the machine's own
        "print('find_spec', importlib.util.find_spec('pydantic'))\n"
        "try:\n"
        "    import wandb\n"
        "except ModuleNotFoundError as err:\n"
        "    print('import', err)\n"
    )
    proc = run_guarded(code, log)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["find_spec None", "import No module named 'wandb'"]
    logged = [line.split() for line in log.read_text().splitlines()]
    assert [(row[1], row[2].split(":")[0]) for row in logged] == [
        ("pydantic", "<string>"),
        ("wandb", "<string>"),
    ]


def test_fleetrls_own_optional_import_fails_there_when_its_feature_is_switched_on(tmp_path):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from launcher.config import LoggingConfig\n"
        "from launcher.tracking import Tracker\n"
        "Tracker(LoggingConfig(wandb=True), Path(sys.argv[1]), 1, {})\n"
    )
    env = guard_env({**os.environ, "PYTHONPATH": str(REPO)}, tmp_path / "guard.log")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().endswith("ModuleNotFoundError: No module named 'wandb'")
    assert "launcher/tracking.py" in (tmp_path / "guard.log").read_text()
