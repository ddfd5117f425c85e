"""Torch threads per role: the reserved CPUs, scaled to the cores a local machine leaves idle."""

from __future__ import annotations

import os
import sys
import types

import pytest

from fleetrl.threads import THREADS_PER_CPU_ENV, role_threads, threads_per_cpu
from launcher.config import load_run_config


@pytest.mark.parametrize(
    ("cores", "reserved", "expected"),
    [(16, 2, 8), (2, 2, 1), (2, 5, 1), (3, 2, 1), (8, 0, 1), (12, 2.5, 4)],
)
def test_each_reserved_cpu_gets_its_share_of_the_cores(cores, reserved, expected):
    assert threads_per_cpu(cores, reserved) == expected


def test_a_role_runs_its_cpus_times_the_share(monkeypatch):
    monkeypatch.delenv(THREADS_PER_CPU_ENV, raising=False)
    assert role_threads(1.0) == 1 and role_threads(4.0) == 4 and role_threads(0.0) == 1
    monkeypatch.setenv(THREADS_PER_CPU_ENV, "8")
    assert role_threads(1.0) == 8 and role_threads(0.5) == 4
    monkeypatch.setenv(THREADS_PER_CPU_ENV, "not a number")
    assert role_threads(2.0) == 2


def test_a_local_instance_tells_every_role_its_share(tmp_path, monkeypatch):
    from launcher import placement

    calls = []  # the environment the local instance's processes start with (they inherit it)
    fake = types.SimpleNamespace(init=lambda **kw: calls.append((kw, dict(os.environ))))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(placement, "usable_cpus", lambda: 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv(THREADS_PER_CPU_ENV, raising=False)
    cfg = load_run_config("configs/demo_cpu.yaml", [f"trainer.output_dir={tmp_path}"])
    assert placement.init_ray(cfg, None)  # the demo reserves 1 learner CPU + 1 engine CPU
    kwargs, env = calls[0]
    assert env[THREADS_PER_CPU_ENV] == "8" and env["OMP_NUM_THREADS"] == "1"
    assert "runtime_env" not in kwargs  # no per-worker environment to make on a local instance
    # this process's own environment is as it was
    assert os.environ["OMP_NUM_THREADS"] == "7" and THREADS_PER_CPU_ENV not in os.environ
