"""``init_ray`` on a real local Ray instance whose first start runs out Ray's fixed wait
for its raylet: the first attempt's processes are ended, a second start serves the run.

Ray's own code raises its own exception here: the raylet's registration is made to fail
once (``services.get_node``), and the clock Ray's node module reads jumps past its 30 s
wait (instead of the test waiting it out).
"""

from __future__ import annotations

import os
import time
import types

import pytest
import ray
from ray._private import node as ray_node
from ray._private import services

from launcher.config import load_run_config
from launcher.local_ray import _alive, descendants
from launcher.placement import init_ray, shutdown_local_ray

pytestmark = pytest.mark.timeout(180)


class FirstWaitRunsOut:
    """The first start's wait for its raylet runs out; the later ones are Ray's own."""

    def __init__(self) -> None:
        self.real_get_node = services.get_node
        self.jump = 0.0
        # this process's own before the start (a test worker may hold others' processes)
        self.before = descendants(os.getpid()) or set()
        self.first_start: set[int] = set()  # every process the first attempt had started

    def get_node(self, *args, **kwargs):
        if not self.jump:
            self.jump = 31.0  # past Ray's 30 s, from here on (its clock moves evenly after)
            self.first_start = (descendants(os.getpid()) or set()) - self.before
            raise RuntimeError("the raylet has not registered (this test)")
        return self.real_get_node(*args, **kwargs)

    def monotonic(self) -> float:
        return time.monotonic() + self.jump


@ray.remote
def _square(x: int) -> int:
    return x * x


def test_a_start_that_ran_out_of_rays_raylet_wait_is_ended_and_made_again(tmp_path, monkeypatch):
    ran_out = FirstWaitRunsOut()
    monkeypatch.setattr(services, "get_node", ran_out.get_node)
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("__")})  # fmt: skip
    clock.monotonic = ran_out.monotonic
    monkeypatch.setattr(ray_node, "time", clock)
    cfg = load_run_config(None, [f"trainer.output_dir={tmp_path / 'run'}", "ray.num_cpus=1"])
    try:
        assert init_ray(cfg, None) is True
        assert ray.is_initialized()
        assert ray.get(_square.remote(7)) == 49  # the second instance serves
        # the first attempt's GCS, raylet, reaper and helpers (and their children) are gone
        assert ran_out.first_start, "the first attempt started no processes?"
        assert not [p for p in ran_out.first_start if _alive(p)]
    finally:
        shutdown_local_ray()
