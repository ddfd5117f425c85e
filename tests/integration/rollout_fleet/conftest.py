"""Fixtures of the rollout integration tests: the tiny model's tokenizer and one embedded engine
serving it on loopback (a test module may define its own ``engine`` instead), and ``engines``
to start several."""

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


@pytest.fixture
def engines(tiny_model_dir):
    """``engines(count)`` starts that many embedded engines e0, e1, ...; all stop after the test."""
    started = []

    def start(count):
        for i in range(count):
            engine = EmbeddedEngine(tiny_model_dir, engine_id=f"e{i}", max_running_requests=16)
            engine.start_server()
            started.append(engine)
        return started

    yield start
    for engine in started:
        engine.stop()
