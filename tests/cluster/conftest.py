"""One real Slurm (munged, slurmctld, two slurmd: slurm_site.py) for every test of the session
that submits to it: starting it takes seconds, and each test's jobs end before the next."""

from __future__ import annotations

import pytest

from tests.cluster.slurm_site import SlurmSite, missing_tools


@pytest.fixture(scope="session")
def slurm():
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"Slurm test: {' '.join(missing)} not installed (apt-get install slurm-wlm munge)"
        )
    site = SlurmSite()
    site.start()
    yield site
    site.stop()
