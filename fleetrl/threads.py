"""Torch threads of a role: the CPUs Ray reserved for it, scaled to the cores it owns.

Ray gives every worker ``OMP_NUM_THREADS=1`` and the roles set their torch threads
from their reservation (``learner.cpus_per_rank``, ``rollout.cpus_per_engine``): a
1-CPU role computes on one thread. On a local instance the machine may have more
cores than the run reserves (the CPU demo asks for 2; a 16-core laptop has 16):
those cores would idle. ``init_ray`` then declares every core to Ray and sets
``FLEETRL_THREADS_PER_CPU`` = cores ÷ CPUs reserved (rounded down, at least 1) in
the roles' environment, and each role runs ``role_threads(its CPUs)`` threads:
its share of the machine, with no two roles' threads on one core. On a cluster
the variable is unset and a role runs as many threads as it reserved CPUs.

Left out: lending an idle role's cores to the busy one (at η = 0 the learner and
the engines take turns; they keep their own shares).
"""

from __future__ import annotations

import os

THREADS_PER_CPU_ENV = "FLEETRL_THREADS_PER_CPU"


def threads_per_cpu(cores: int, reserved_cpus: float) -> int:
    """Threads each reserved CPU gets on a machine of ``cores`` cores (at least 1)."""
    if reserved_cpus <= 0:
        return 1
    return max(1, int(cores // reserved_cpus))


def role_threads(cpus: float) -> int:
    """Torch threads for a role that reserved ``cpus`` CPUs (at least 1)."""
    try:
        scale = max(1, int(os.environ.get(THREADS_PER_CPU_ENV, "1")))
    except ValueError:
        scale = 1
    return max(1, int(cpus * scale))
