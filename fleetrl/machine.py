"""What this machine offers a run: the CPUs this process may really use.

``os.cpu_count()`` counts the host's cores, not the ones a container or a CPU set gives
this process: in a container limited to 2 CPUs on a 256-core host it says 256, and a run
sized by it starts 256 Ray workers' worth of actors on 2 cores. ``usable_cpus`` takes the
smallest of the CPU affinity mask (``os.sched_getaffinity``: taskset, cpusets) and the
cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
rounded up to whole CPUs, as the JVM and Go runtimes do.

Left out: the cgroup of a nested hierarchy's ancestors (only this process's own cgroup and
the root of the mount are read).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_v2_dir(root: Path) -> Path:
    """This process's cgroup v2 folder (``0::/path`` in /proc/self/cgroup), else the root."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].lstrip("/")
                if (own / "cpu.max").is_file():
                    return own
    except OSError:
        pass
    return root


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (e.g. 2.0), or None when it sets none."""
    try:
        text = (_cgroup_v2_dir(root) / "cpu.max").read_text().split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
        if text:
            return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """Whole CPUs this process can use: affinity mask and cgroup quota, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)
