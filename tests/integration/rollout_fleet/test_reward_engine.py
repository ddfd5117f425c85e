"""The embedded engine serving a reward model over HTTP: ``/classify`` and ``/encode``.

Proves: the score is transformers' ``AutoModelForSequenceClassification`` logit for the
unpadded sequence (Qwen2 and Llama heads; batches of mixed lengths, scored padded, give
the same numbers as one forward per sequence); text is tokenized as the tokenizer does;
replies have SGLang's shape (a list for a batch, in order, rids kept); bad bodies are 400s
naming what is wrong; requests in flight together share forwards; ``/generate`` is refused;
``/model_info`` says ``is_generation: false``; the API key guards it off loopback;
``/update_weights_from_disk`` swaps the weights (a bad folder changes nothing); a folder's
architecture picks the engine.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import requests
import torch

from fleetrl.models.tiny import make_tiny_model
from rollout_fleet.engine.kinds import open_engine
from rollout_fleet.engine.reward_server import RewardEngine
from rollout_fleet.engine.server import EmbeddedEngine

INPUTS = [[10, 11, 12, 13], [20, 21], [5, 6, 7, 8, 9, 10, 11, 12, 13], [30], [7, 7, 7, 40, 41]]


def hf_scores(model_dir, batch: list[list[int]]) -> list[float]:
    """transformers' score of each sequence, one unpadded forward each."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in batch]


@pytest.fixture(scope="module")
def engine(tiny_reward_dir):
    eng = RewardEngine(str(tiny_reward_dir), engine_id="rm-test", max_running_requests=16)
    url = eng.start_server()
    yield eng, url
    eng.stop()


def post(url: str, body: dict, path: str = "/classify", **kwargs) -> requests.Response:
    return requests.post(url + path, json=body, timeout=60, **kwargs)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_scores_equal_transformers_for_each_unpadded_sequence(arch, tmp_path):
    folder = make_tiny_model(tmp_path / arch, arch=arch, layers=2, hidden=32, heads=4, seed=7, reward_model=True)  # fmt: skip
    eng = RewardEngine(str(folder), engine_id=f"rm-{arch}", max_running_requests=8)
    url = eng.start_server()
    try:
        reply = post(url, {"input_ids": INPUTS})
        assert reply.status_code == 200, reply.text
        ours = [item["embedding"][0] for item in reply.json()]
        single = [post(url, {"input_ids": ids}).json()["embedding"][0] for ids in INPUTS]
    finally:
        eng.stop()
    expected = hf_scores(folder, INPUTS)
    assert ours == pytest.approx(expected, abs=1e-5)
    assert single == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in expected)) == len(INPUTS)  # distinct: order matters


def test_batch_reply_is_sglangs_shape_in_order_with_the_rids(engine):
    _, url = engine
    rids = [f"item-{i}" for i in range(len(INPUTS))]
    reply = post(url, {"input_ids": INPUTS, "rid": rids}).json()
    assert isinstance(reply, list) and [r["meta_info"]["id"] for r in reply] == rids
    for item, ids in zip(reply, INPUTS, strict=True):
        assert set(item) == {"embedding", "meta_info"} and len(item["embedding"]) == 1
        meta = item["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["weight_version"] == "0" and meta["num_retractions"] == 0
        assert meta["e2e_latency"] >= 0 and meta["response_sent_to_client_ts"] > 0
    single = post(url, {"input_ids": INPUTS[0], "rid": "one"}).json()
    assert isinstance(single, dict) and single["meta_info"]["id"] == "one"
    assert single["embedding"] == pytest.approx(reply[0]["embedding"], abs=1e-6)


def test_encode_and_put_answer_as_classify(engine):
    _, url = engine
    expected = post(url, {"input_ids": INPUTS[1]}).json()["embedding"]
    assert post(url, {"input_ids": INPUTS[1]}, path="/encode").json()["embedding"] == expected
    put = requests.put(url + "/classify", json={"input_ids": INPUTS[1]}, timeout=30)
    assert put.json()["embedding"] == expected


def test_text_is_scored_as_its_tokenizer_encodes_it(engine, tiny_reward_dir):
    from transformers import AutoTokenizer

    _, url = engine
    texts = ["2 + 2 = 4", "the answer is 5"]
    ids = AutoTokenizer.from_pretrained(tiny_reward_dir)(texts)["input_ids"]
    by_text = [r["embedding"] for r in post(url, {"text": texts}).json()]
    by_ids = [r["embedding"] for r in post(url, {"input_ids": ids}).json()]
    assert by_text == [pytest.approx(e, abs=1e-6) for e in by_ids]
    assert post(url, {"text": texts[0]}).json()["meta_info"]["prompt_tokens"] == len(ids[0])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 2], "temperature": 1.0}, "unknown field `temperature`"),
        ({"input_ids": [1, 2], "image_data": "x.png"}, "$.image_data"),
        ({"text": "a", "input_ids": [1]}, "text and input_ids cannot be provided at the same time"),
        ({}, "At least one of text, input_ids"),
        ({"input_ids": [[1, 2], [3]], "rid": "batch"}, "The rid should be a list."),
        ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "Duplicate request IDs"),
        ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "rid has 1 entries for a batch of 2"),
        ({"input_ids": [1, 99999]}, "token id 99999, outside the vocabulary"),
        ({"input_ids": [[1], []]}, "input 1 is empty"),
        ({"input_ids": [1] * 600}, "longer than the model's context length (512 tokens)"),
        ({"input_ids": [1], "lora_path": "adapter"}, "LoRA adapter 'adapter' was requested"),
        ({"input_ids": [1], "dimensions": 8}, "does not support matryoshka"),
        ({"input_ids": [1], "is_cross_encoder_request": True}, "$.is_cross_encoder_request"),
        ({"input_ids": [1], "decision_layout": [1]}, "decision_layout is set only by"),
        ({"input_ids": [1], "priority": 1 << 64}, "priority must be a signed 64-bit integer"),
    ],
)
def test_bad_bodies_are_400_naming_what_is_wrong(engine, body, message):
    _, url = engine
    reply = post(url, body)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_fields_sglang_ignores_for_scoring_are_accepted(engine):
    _, url = engine
    plain = post(url, {"input_ids": INPUTS[2]}).json()["embedding"]
    body = {
        "input_ids": INPUTS[2],
        "sampling_params": {"max_new_tokens": 5},
        "priority": 3,
        "log_metrics": False,
        "routing_key": "k",
        "return_prompt_token_ids": True,
        "lora_path": None,
    }
    assert post(url, body).json()["embedding"] == pytest.approx(plain, abs=1e-6)


def test_requests_in_flight_together_share_forwards(engine):
    eng, url = engine
    before_forwards, before_requests = eng.runner.forwards_run, eng.worker.requests
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda ids: post(url, {"input_ids": ids}), INPUTS * 6))
    assert all(r.status_code == 200 for r in replies)
    assert eng.worker.requests - before_requests == len(INPUTS) * 6
    # merged rounds: fewer forwards than requests (the first request may run alone)
    assert eng.runner.forwards_run - before_forwards < len(INPUTS) * 6
    expected = {tuple(ids): post(url, {"input_ids": ids}).json()["embedding"] for ids in INPUTS}
    for ids, reply in zip(INPUTS * 6, replies, strict=True):
        assert reply.json()["embedding"] == pytest.approx(expected[tuple(ids)], abs=1e-6)


def test_generate_is_refused_and_model_info_says_not_a_generation_model(engine):
    _, url = engine
    refused = post(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, "/generate")  # fmt: skip
    assert refused.status_code == 400 and "/classify" in refused.json()["error"]["message"]
    info = requests.get(url + "/model_info", timeout=10).json()
    assert info["is_generation"] is False and info["weight_version"] == "0"
    assert info["architectures"] == ["Qwen2ForSequenceClassification"]
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/health_generate", timeout=30).status_code == 200


def test_off_loopback_needs_the_key_and_every_scoring_call_carries_it(tiny_reward_dir):
    from rollout_fleet.engine.http_service import EngineStartupError

    with pytest.raises(EngineStartupError, match="API key"):
        RewardEngine(str(tiny_reward_dir), engine_id="open").start_server(host="0.0.0.0")
    eng = RewardEngine(str(tiny_reward_dir), engine_id="keyed", api_key="secret")
    url = eng.start_server()
    try:
        assert post(url, {"input_ids": [1, 2]}).status_code == 401
        keyed = post(url, {"input_ids": [1, 2]}, headers={"Authorization": "Bearer secret"})
        assert keyed.status_code == 200
        assert requests.get(url + "/health", timeout=10).status_code == 200  # as in SGLang
    finally:
        eng.stop()


def test_update_weights_from_disk_swaps_the_model_and_a_bad_folder_changes_nothing(tiny_reward_dir, tmp_path):  # fmt: skip
    other = make_tiny_model(tmp_path / "other", layers=2, hidden=64, heads=4, seed=9, reward_model=True)  # fmt: skip
    eng = RewardEngine(str(tiny_reward_dir), engine_id="rm-disk")
    url = eng.start_server()
    try:
        before = post(url, {"input_ids": INPUTS}).json()
        bad = post(url, {"model_path": str(tmp_path / "none")}, "/update_weights_from_disk")
        assert bad.status_code == 400 and bad.json()["success"] is False
        unchanged = post(url, {"input_ids": INPUTS}).json()
        assert [u["embedding"] for u in unchanged] == [b["embedding"] for b in before]
        done = post(url, {"model_path": str(other), "weight_version": "7"}, "/update_weights_from_disk")  # fmt: skip
        assert done.status_code == 200 and done.json()["success"] is True
        after = post(url, {"input_ids": INPUTS}).json()
    finally:
        eng.stop()
    assert [a["embedding"][0] for a in after] == pytest.approx(hf_scores(other, INPUTS), abs=1e-5)
    assert after[0]["meta_info"]["weight_version"] == "7"


def test_the_folder_picks_the_engine(tiny_reward_dir, tiny_model_dir):
    reward = open_engine(tiny_reward_dir, engine_id="pick-rm")
    policy = open_engine(tiny_model_dir, engine_id="pick-lm", max_running_requests=2)
    try:
        assert isinstance(reward, RewardEngine) and isinstance(policy, EmbeddedEngine)
    finally:
        reward.stop()
        policy.stop()
