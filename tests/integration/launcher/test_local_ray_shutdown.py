"""``launcher.placement.shutdown_local_ray`` on a real local Ray instance: the autoscaler
monitor is ended first, at once (not left to wait out Ray's grace on a GCS already gone),
and every process of the instance has exited when it returns."""

from __future__ import annotations

import signal

import pytest
import ray
from ray._private import ray_constants, worker

from launcher.placement import shutdown_local_ray

pytestmark = pytest.mark.timeout(120)


def test_the_monitor_goes_first_and_nothing_of_the_instance_is_left(monkeypatch):
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    node = worker._global_node
    processes = [info.process for infos in node.all_processes.values() for info in infos]
    monitor = node.all_processes[ray_constants.PROCESS_TYPE_MONITOR][0].process
    gcs = node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER][0].process
    assert monitor.poll() is None  # running before
    ended: list[tuple[str, bool]] = []  # (process type, whether the GCS still ran then)
    kill = type(node)._kill_process_type

    def watched(self, process_type, *args, **kwargs):
        kill(self, process_type, *args, **kwargs)
        ended.append((process_type, gcs.poll() is None))

    monkeypatch.setattr(type(node), "_kill_process_type", watched)

    shutdown_local_ray()

    assert not ray.is_initialized()
    # ended outright while the GCS still ran (Ray's own order reaches it after the GCS)
    assert ended[0] == (ray_constants.PROCESS_TYPE_MONITOR, True)
    assert monitor.returncode == -signal.SIGKILL
    assert all(p.poll() is not None for p in processes), [p.args[:2] for p in processes]


def test_without_a_local_instance_it_is_ray_shutdown():
    assert not ray.is_initialized()
    shutdown_local_ray()  # nothing started: nothing to end, no error
    assert not ray.is_initialized()
