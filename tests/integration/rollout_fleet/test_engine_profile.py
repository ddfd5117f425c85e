"""SGLang's /start_profile and /stop_profile on the embedded engine: the span between them is
one Chrome trace of the engine process, the scheduler's forward passes included."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout_fleet.client import EngineClient, EngineError
from rollout_fleet.engine.server import EmbeddedEngine

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = EmbeddedEngine(tiny_model_dir, engine_id="profiled", max_running_requests=4)
    eng.start_server()
    yield eng
    eng.stop()


def test_a_profiled_span_is_a_chrome_trace_with_the_engines_forward_passes(engine, tmp_path):
    async def scenario():
        async with EngineClient(engine.base_url) as client:
            await client.start_profile(str(tmp_path / "step_2"), "engine_")
            await client.generate([5, 6, 7, 8], GREEDY)
            await client.stop_profile()
            with pytest.raises(EngineError, match="no profile is being recorded"):
                await client.stop_profile()  # a stop without a start is SGLang's 400

    asyncio.run(scenario())
    trace = json.loads((tmp_path / "step_2" / "engine_profiled.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)  # the model's ops, on its thread
    assert any(
        "linear" in name or "addmm" in name or name.split("::")[-1] == "mm" for name in names
    )


def test_a_second_start_is_refused_and_the_first_span_still_ends(engine, tmp_path):
    async def scenario():
        async with EngineClient(engine.base_url) as client:
            await client.start_profile(str(tmp_path), "again_")
            with pytest.raises(EngineError, match="already being recorded"):
                await client.start_profile(str(tmp_path), "again_")
            await client.stop_profile()

    asyncio.run(scenario())
    assert (tmp_path / "again_profiled.json").is_file()
