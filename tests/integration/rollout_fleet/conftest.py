"""Fixtures of the rollout integration tests: the tiny model's tokenizer and one embedded engine
serving it on loopback (a test module may define its own ``engine`` instead)."""

from __future__ import annotations

import pytest

from rollout_fleet.engine.server import EmbeddedEngine


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def engine(tiny_model_dir):
    started = EmbeddedEngine(tiny_model_dir, engine_id="e0", max_running_requests=16)
    started.start_server()
    yield started
    started.stop()
