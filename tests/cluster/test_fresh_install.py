"""A newcomer's first screen: `make venv` on a fresh virtualenv says what it installs and why,
one line a step, and prints nothing that looks like an error (pip's dependency-conflict report
for the GPU packages the conformance tier leaves out on purpose, build-backend warnings).

Runs under ``make test-deploy`` (marker ``deploy``): it installs torch's 3.2 GB again, from
pip's cache where the machine has one. Lines pip prints about the machine's own package-index
configuration (``WARNING: Location ... is ignored``) are the machine's, not the project's.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MACHINE_LINE = re.compile(r"^WARNING: Location '.*' is ignored")

pytestmark = [pytest.mark.deploy, pytest.mark.slow]


@pytest.mark.timeout(2400)
def test_make_venv_prints_one_line_per_step_and_nothing_like_an_error(scratch: Path):
    venv = scratch / "venv"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        ["make", "-s", "venv", f"VENV={venv}"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=2300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip() and not MACHINE_LINE.match(line)
    ]
    assert lines and all(line.startswith("venv: ") for line in lines), "\n".join(lines[:40])
    said = "\n".join(lines)
    assert "torch==2.14.1" in said and "CUDA build" in said  # what, and why it is that build
    assert "sglang==" in said and "no GPU dependencies" in said
    assert (venv / ".installed").is_file() and (venv / ".installed-conformance").is_file()
