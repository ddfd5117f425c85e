"""The driver itself is killed with SIGKILL: every role process of the run goes with it.

Ray fate-shares a local instance's GCS and raylet with the driver that started it, and the
role actors with the raylet. Measured gap (not asserted here, see docs/fault_tolerance.md):
Ray's ``DashboardAgent`` and ``RuntimeEnvAgent`` processes outlive a SIGKILLed driver for
over a minute. Resuming after such a kill is the same path as after a learner death
(tests/e2e/test_faults.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.e2e.test_faults import REPO, _alive, _cmd, _env, _roster, _wait_for_step

pytestmark = pytest.mark.slow


def test_a_killed_driver_takes_every_role_process_with_it(tmp_path):
    run_dir = tmp_path / "run"
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(
            _cmd(tmp_path, run_dir, 30), cwd=REPO, env=_env(), stdout=log, stderr=log
        )
        try:
            _wait_for_step(proc, run_dir, 1, 300)
            roles = _roster(run_dir)
            assert roles["driver"] == proc.pid
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    deadline = time.monotonic() + 60
    while (left := [r for r, p in roles.items() if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], f"role processes left after the driver was killed: {left}"
