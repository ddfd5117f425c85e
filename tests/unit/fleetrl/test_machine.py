"""usable_cpus: the CPUs this process may use, from its affinity mask and its cgroup's quota,
not the host's core count (a 2-CPU container on a 256-core host has 2)."""

from __future__ import annotations

import os

from fleetrl.machine import cgroup_cpu_quota, usable_cpus


def test_a_cgroup_v2_quota_bounds_the_cpus(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == min(2, len(os.sched_getaffinity(0)))


def test_no_quota_leaves_the_affinity_mask(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path / "absent") == len(os.sched_getaffinity(0))


def test_a_cgroup_v1_quota_is_read_too(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.0
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_cpu_quota(tmp_path) is None
