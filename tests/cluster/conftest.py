"""Fixtures of the cluster tier: one real Slurm (munged, slurmctld, two slurmd: slurm_site.py)
for every test of the session that submits to it (starting it takes seconds, and each test's
jobs end before the next); a scratch folder for the tests that install gigabytes."""

from __future__ import annotations

import shutil

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


@pytest.fixture
def scratch(tmp_path_factory):
    """A folder for one test's installs (a virtualenv with torch's CUDA libraries, a node's
    home): removed when the test ends, pass or fail, since pytest keeps its last three runs'
    temporary folders and three runs of these tiers fill a CI machine's disk."""
    folder = tmp_path_factory.mktemp("scratch")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
