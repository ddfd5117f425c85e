"""The vLLM conformance tier's engines: vLLM 0.34's own app over the harness (harness.py),
started on command lines fleetrl's launcher builds. Module-scoped: TP 1 and TP 2."""

from __future__ import annotations

import pytest

from tests.conformance.vllm.launch import start_vllm_engine


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    engine = start_vllm_engine(tiny_model_dir, tp_size=1)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def vllm_engine_tp2(tiny_model_dir):
    engine = start_vllm_engine(tiny_model_dir, tp_size=2, enable_prefix_caching=False, lora_rank=8)
    yield engine
    engine.stop()
