"""Learner test fixtures: a one-rank gloo group in this process."""

from __future__ import annotations

import pytest
import torch

from learner import dist as ldist
from tests.integration.learner.procs import free_port


@pytest.fixture
def group():
    """The learner's process group with this process as its only rank (FSDP2 over it)."""
    ldist.init_group(
        master_addr="127.0.0.1", master_port=free_port(), rank=0, world_size=1,
        device=torch.device("cpu"),
    )  # fmt: skip
    yield
    ldist.close_group()
