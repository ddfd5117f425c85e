"""A reward model that scores one input NaN, served by SGLang 0.5.23's own ``/classify``
(the harness of ``sglang_engine``) and by the embedded reward engine, scored through the
real client: that input alone comes back NaN (its sample fails), the others are scored.

SGLang cannot write a NaN score (its JSON refuses it) and answers the whole batch 500;
the embedded engine writes null. The client handles both (rollout_fleet/rewards/model_client.py).
"""

from __future__ import annotations

import asyncio
import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from rollout_fleet.engine.reward_server import RewardEngine
from rollout_fleet.rewards.model_client import RewardModelClient
from tests.conformance.conftest import CONFORMANCE_API_KEY
from tests.conformance.sglang_engine import start_sglang_engine

POISON = 30  # a token whose embedding is NaN: every sequence holding it scores NaN
BATCH = [[10, 11, 12], [20, POISON, 21], [5, 6], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def nan_reward_dir(tiny_reward_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("nan_rm") / "model"
    shutil.copytree(tiny_reward_dir, folder)
    for path in folder.glob("*.safetensors"):
        weights = load_file(path)
        for name, tensor in weights.items():
            if "embed_tokens" in name:
                tensor[POISON] = math.nan
        save_file(weights, path, metadata={"format": "pt"})
    return folder


def score(url: str) -> tuple[list[float], dict[str, float]]:
    async def run():
        client = RewardModelClient(
            {"server": url}, api_key=CONFORMANCE_API_KEY, batch_size=4, request_timeout_s=30.0,
            max_attempts=2, retry_backoff_s=0.0,
        )  # fmt: skip
        try:
            return await client.score(BATCH), client.stats()
        finally:
            await client.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("server", ["sglang", "embedded"])
def test_a_nan_score_comes_back_for_its_input_alone(nan_reward_dir, server):
    if server == "sglang":
        engine = start_sglang_engine(nan_reward_dir, api_key=CONFORMANCE_API_KEY, is_embedding=True)  # fmt: skip
        url, stop = engine.url, engine.stop
    else:
        engine = RewardEngine(str(nan_reward_dir), engine_id="rm-nan", api_key=CONFORMANCE_API_KEY)  # fmt: skip
        url, stop = engine.start_server(), engine.stop
    try:
        scores, stats = score(url)
    finally:
        stop()
    assert [math.isnan(s) for s in scores] == [False, True, False, False]
    assert stats["reward_model/failures"] == 0
    if server == "sglang":  # the batch was answered 500 and split until the input was alone
        assert stats["reward_model/splits"] >= 2 and stats["reward_model/inputs_refused"] == 1
