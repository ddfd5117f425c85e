"""``launcher.local_ray.start_local``: a start whose wait for its raylet ran out is made
again once, after the processes it started (and theirs) are ended by id; a process another
thread started meanwhile is left alone; any other error is raised at once.
(tests/integration/launcher/test_local_ray_start.py runs it on Ray itself.)"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from launcher import local_ray
from launcher.local_ray import _alive, descendants, start_local

RAY_DIR = "/opt/fake-ray-folder"
TIMED_OUT = Exception("The current node timed out during startup. This could happen ...")
# a child that starts a child of its own, then sleeps: a Ray program when RAY_DIR is its argv
PARENT = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


def _wait_for_grandchild(proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = descendants(proc.pid)
        if found:
            return found.pop()
        time.sleep(0.05)
    raise AssertionError("the child started no child of its own")


def test_a_timed_out_start_ends_what_it_started_and_is_made_once_more():
    calls, started = [], {}

    def init() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            started["ray"] = subprocess.Popen([sys.executable, "-c", PARENT, RAY_DIR])
            started["grandchild"] = _wait_for_grandchild(started["ray"])
            started["other"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # fmt: skip
            raise TIMED_OUT

    try:
        start_local(init, RAY_DIR)
        assert len(calls) == 2
        assert started["ray"].poll() is not None  # ended and reaped
        assert not _alive(started["grandchild"])
        assert started["other"].poll() is None  # not Ray's: left running
    finally:
        for name in ("ray", "other"):
            if name in started and started[name].poll() is None:
                started[name].kill()
                started[name].wait()


def _attempts(error: Exception) -> int:
    """How many times ``start_local`` called an ``init`` that always raises ``error``
    (raised on to the caller, as the assertion checks)."""
    calls = []

    def init() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error), match=re.escape(str(error)[:20])):
        start_local(init, RAY_DIR)
    return len(calls)


def test_a_second_timeout_and_any_other_error_are_raised_as_they_were():
    assert _attempts(TIMED_OUT) == local_ray.START_ATTEMPTS
    assert _attempts(ValueError("Resource 'CPU' is negative")) == 1


def test_without_proc_the_timeout_is_raised_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(local_ray, "PROC", tmp_path / "no-proc")
    assert _attempts(TIMED_OUT) == 1
