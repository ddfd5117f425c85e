"""SampleRunner with LoRA: names the engine's adapter, follows it when it is gone, tags by it."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.adapters import AdapterNames
from rollout_fleet.client import EngineError, generate_sample_sglang
from rollout_fleet.membership import Membership
from rollout_fleet.router import Router
from rollout_fleet.sample_runner import SampleFailed, SampleRunner
from rollout_fleet.trajectory import SampleProgress
from weight_sync.adapters import adapter_name


class AdapterEngine:
    """Serves only ``adapter_name(held)``; SGLang's 400 for any other name."""

    def __init__(self, held: int, reported: int | None = None, version_fails: bool = False):
        self.held = held
        self.reported = held if reported is None else reported
        self.version_fails = version_fails
        self.names: list[str | None] = []

    async def get_weight_version(self) -> str:
        if self.version_fails:
            raise EngineError("http://e", "/model_info", None, "connection refused")
        return str(self.reported)

    generate_sample = generate_sample_sglang  # the engine interface over SGLang's format

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, **extra):
        name = extra.get("lora_path")
        self.names.append(name)
        if name != adapter_name(self.held):
            raise EngineError(
                "http://e",
                "/generate",
                400,
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: ['{adapter_name(self.held)}'].",
            )
        n = sampling_params["max_new_tokens"]
        return {
            "output_ids": [7] * n,
            "meta_info": {
                "finish_reason": {"type": "length", "length": n},
                "weight_version": str(self.held + 1),  # the tag moved on; the adapter did not
                "output_token_logprobs": [[-0.5, 7, None]] * n,
                "prompt_tokens": len(input_ids),
            },
        }

    async def abort_request(self, rid=None, abort_all=False):
        return None


def _run(engine: AdapterEngine, adapters: AdapterNames, attempts: int = 4) -> SampleProgress:
    members = Membership()
    members.launch("e", "http://e")
    members.weights_loaded("e", 0)
    router = Router(members)
    runner = SampleRunner(
        router, {"e": engine}, max_attempts=attempts, retry_backoff_s=0.0, adapters=adapters
    )
    sample = SampleProgress(prompt_ids=[1, 2, 3], max_new_tokens=3)
    asyncio.run(runner.generate("g", "u", sample, {"temperature": 1.0}))
    return sample


def test_tokens_carry_the_version_of_the_adapter_the_request_named():
    adapters = AdapterNames()
    sample = _run(AdapterEngine(held=4), adapters)
    assert sample.token_versions == [4, 4, 4]  # not the engine's tag (5)
    assert adapters.refreshes == 1


def test_a_gone_adapter_is_followed_to_the_engines_current_one():
    adapters = AdapterNames()
    adapters.observe("e", "2")  # the worker last saw v2; the engine moved to v3
    engine = AdapterEngine(held=3)
    sample = _run(engine, adapters)
    assert engine.names == [adapter_name(2), adapter_name(3)]
    assert sample.token_versions == [3, 3, 3]


def test_an_engine_stuck_on_a_gone_adapter_fails_the_sample_after_max_attempts():
    engine = AdapterEngine(held=3, reported=2)  # it says v2 but serves only v3
    adapters = AdapterNames()
    with pytest.raises(SampleFailed):
        _run(engine, adapters, attempts=3)
    with pytest.raises(SampleFailed, match="connection refused"):
        _run(AdapterEngine(held=1, version_fails=True), AdapterNames(), attempts=2)


def test_requests_that_meet_a_switch_together_ask_the_engine_once():
    adapters = AdapterNames()
    adapters.observe("e", "2")
    engine = AdapterEngine(held=3)
    members = Membership()
    members.launch("e", "http://e")
    members.weights_loaded("e", 0)
    router = Router(members)
    runner = SampleRunner(router, {"e": engine}, retry_backoff_s=0.0, adapters=adapters)
    samples = [SampleProgress(prompt_ids=[1, 2, 3], max_new_tokens=3) for _ in range(8)]

    async def go():
        await asyncio.gather(
            *(runner.generate(f"g{i}", f"u{i}", s, {}) for i, s in enumerate(samples))
        )

    asyncio.run(go())
    assert adapters.refreshes == 1
    assert all(s.token_versions == [3, 3, 3] for s in samples)
