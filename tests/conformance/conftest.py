"""Conformance-tier fixtures: SGLang's own HTTP server on CPU over our engine internals.

``sglang_engine`` (TP 1, API key ``CONFORMANCE_API_KEY``) and ``sglang_engine_tp2``
(TP 2, no key) are module-scoped: each test module starts them once, on the
session's ``tiny_model_dir``; ``sglang_reward_engine`` serves ``tiny_reward_dir`` with
``--is-embedding`` and the key. ``sglang_engine_factory(tp_size=..., api_key=...)``
starts any other shape for one test and stops it afterwards.
"""

from __future__ import annotations

import pytest

from tests.conformance.sglang_engine import SGLangEngine, start_sglang_engine

CONFORMANCE_API_KEY = "conformance-key"


@pytest.fixture(scope="module")
def sglang_engine(tiny_model_dir) -> SGLangEngine:
    engine = start_sglang_engine(tiny_model_dir, tp_size=1, api_key=CONFORMANCE_API_KEY)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def sglang_engine_tp2(tiny_model_dir) -> SGLangEngine:
    engine = start_sglang_engine(tiny_model_dir, tp_size=2)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def sglang_reward_engine(tiny_reward_dir) -> SGLangEngine:
    """SGLang's HTTP app serving the tiny reward model with --is-embedding, behind the key."""
    engine = start_sglang_engine(tiny_reward_dir, api_key=CONFORMANCE_API_KEY, is_embedding=True)
    yield engine
    engine.stop()


@pytest.fixture
def sglang_engine_factory(tiny_model_dir):
    started: list[SGLangEngine] = []

    def start(tp_size: int = 1, api_key: str | None = None, model_dir=None) -> SGLangEngine:
        engine = start_sglang_engine(model_dir or tiny_model_dir, tp_size=tp_size, api_key=api_key)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()
