"""The vLLM conformance tier's engines: vLLM 0.34's own app over the harness (harness.py),
started on command lines fleetrl's launcher builds. One TP 1 and one TP 2 engine per module,
started side by side (each takes about a minute to import vLLM and build its app)."""

from __future__ import annotations

import pytest

from tests.conformance.vllm.launch import launch_vllm_engine


@pytest.fixture(scope="module")
def vllm_engines(tiny_model_dir):
    engines = [
        launch_vllm_engine(tiny_model_dir, tp_size=1),
        launch_vllm_engine(tiny_model_dir, tp_size=2, enable_prefix_caching=False, lora_rank=8),
    ]
    try:
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module")
def vllm_engine(vllm_engines):
    return vllm_engines[0]


@pytest.fixture(scope="module")
def vllm_engine_tp2(vllm_engines):
    return vllm_engines[1]
