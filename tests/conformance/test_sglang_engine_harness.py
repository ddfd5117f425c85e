"""The conformance engine behaves as SGLang 0.5.23 does over plain HTTP.

Everything here talks to SGLang's own HTTP app and runs SGLang's own
weight-update code (see ``sglang_engine``); the trainer side of the
rendezvous is SGLang's ``init_custom_process_group`` and, for buckets, its
``FlattenedTensorBucket``. These tests prove the harness, so that fleetrl's
sender and engine client can then be tested against it.
"""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import requests
import torch
import torch.distributed as dist
from sglang.srt.utils import init_custom_process_group
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

from tests.conformance.conftest import CONFORMANCE_API_KEY
from tests.conformance.sglang_engine.launcher import free_port

SESSION_MESSAGE = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
_group_ids = itertools.count()
# A request long enough to still be running when the test pauses the engine (context is 512).
LONG = 480


def post(engine, path: str, body: dict | None = None, **kw) -> requests.Response:
    return requests.post(
        f"{engine.url}{path}", json=body or {}, headers=engine.headers, timeout=120, **kw
    )


def model_info(engine) -> dict:
    return requests.get(f"{engine.url}/model_info", headers=engine.headers, timeout=30).json()


class Trainer:
    """Rank 0 of the weight-update group, formed as a trainer forms it (SGLang's own code)."""

    def __init__(self, engine):
        self.engine = engine
        self.group_name = f"conformance_{next(_group_ids)}"
        port = free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + engine.tp_size,
            "group_name": self.group_name,
            "backend": "gloo",
        }
        reply = {}
        thread = threading.Thread(
            target=lambda: reply.setdefault("r", post(engine, "/init_weights_update_group", body))
        )
        thread.start()
        self.group = init_custom_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=1 + engine.tp_size,
            rank=0,
            group_name=self.group_name,
        )
        thread.join(120)
        assert reply["r"].status_code == 200, reply["r"].text

    def update(
        self,
        named: list[tuple[str, torch.Tensor]],
        version: str,
        load_format: str | None,
        flush_cache: bool = True,
    ) -> requests.Response:
        """POST the metadata while broadcasting the tensors, as the HTTP call waits for them."""
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.group_name,
            "weight_version": version,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        reply = {}
        thread = threading.Thread(
            target=lambda: reply.setdefault(
                "r", post(self.engine, "/update_weights_from_distributed", body)
            )
        )
        thread.start()
        if load_format == "flattened_bucket":
            bucket = FlattenedTensorBucket(named_tensors=named)
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=self.group)
        else:
            for _, tensor in named:
                dist.broadcast(tensor, src=0, group=self.group)
        thread.join(120)
        return reply["r"]

    def sync(self, named, version: str, load_format: str | None, flush_cache: bool = True):
        assert post(self.engine, "/begin_weight_update").status_code == 200
        r = self.update(named, version, load_format, flush_cache)
        assert post(self.engine, "/end_weight_update").status_code == 200
        return r

    def close(self) -> None:
        r = post(self.engine, "/destroy_weights_update_group", {"group_name": self.group_name})
        assert r.status_code == 200, r.text
        dist.destroy_process_group(self.group)


def new_weights(engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    current = engine.rank_weights()[0]
    return [
        (name, (t + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype))
        for name, t in current.items()
    ]


def assert_every_rank_holds(engine, named) -> None:
    for rank, weights in enumerate(engine.rank_weights()):
        for name, sent in named:
            got = weights[name]
            assert got.dtype == sent.dtype and got.shape == sent.shape, (rank, name)
            assert torch.equal(got.view(torch.uint8), sent.contiguous().view(torch.uint8)), (
                f"TP rank {rank} holds {name} different from what was sent"
            )


def generate(engine, **body) -> dict:
    r = post(engine, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


# -- HTTP surface ------------------------------------------------------------------------------
def test_model_info_reports_weight_version(sglang_engine):
    info = model_info(sglang_engine)
    assert info["weight_version"] == "default"
    assert info["model_type"] == "qwen2"


def test_api_key_is_enforced_by_sglang_middleware(sglang_engine):
    url = sglang_engine.url
    assert requests.get(f"{url}/model_info", timeout=30).status_code == 401
    assert requests.post(f"{url}/begin_weight_update", json={}, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert requests.get(f"{url}/model_info", headers=wrong, timeout=30).status_code == 401
    ok = {"Authorization": f"Bearer {CONFORMANCE_API_KEY}"}
    assert requests.get(f"{url}/model_info", headers=ok, timeout=30).status_code == 200
    # SGLang leaves health probes open
    assert requests.get(f"{url}/health", timeout=60).status_code == 200


def test_update_outside_session_is_refused_with_sglangs_message(sglang_engine):
    r = post(
        sglang_engine,
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
    )
    assert r.status_code == 400
    assert r.json() == {"success": False, "message": SESSION_MESSAGE}


def test_generate_returns_sglang_output_with_model_logprobs(sglang_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = generate(
        sglang_engine,
        input_ids=[7, 8, 9, 10],
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"] and len(entries) == 6
    # the logprobs are the model's: teacher-force the same tokens through the HF model
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[7, 8, 9, 10, *out["output_ids"]]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    expected = [float(logp[3 + i, tok]) for i, tok in enumerate(out["output_ids"])]
    assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-4)
    assert out["output_ids"] == [int(logp[3 + i].argmax()) for i in range(6)]


# -- weight sync -------------------------------------------------------------------------------
@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_broadcast_lands_bit_for_bit_tp1(sglang_engine, load_format):
    trainer = Trainer(sglang_engine)
    try:
        named = new_weights(sglang_engine, seed=1 if load_format else 2)
        version = f"tp1-{load_format}"
        r = trainer.sync(named, version, load_format)
        assert r.status_code == 200, r.text
        assert r.json()["success"] is True
        assert_every_rank_holds(sglang_engine, named)
        assert model_info(sglang_engine)["weight_version"] == version
        assert sglang_engine.rank_weight_versions() == [version]
    finally:
        trainer.close()


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_broadcast_lands_bit_for_bit_on_every_tp_rank(sglang_engine_tp2, load_format):
    engine = sglang_engine_tp2
    trainer = Trainer(engine)
    try:
        named = new_weights(engine, seed=3 if load_format else 4)
        version = f"tp2-{load_format}"
        r = trainer.sync(named, version, load_format)
        assert r.status_code == 200, r.text
        assert_every_rank_holds(engine, named)
        assert model_info(engine)["weight_version"] == version
        assert engine.rank_weight_versions() == [version, version]
    finally:
        trainer.close()


def test_generation_uses_the_broadcast_weights(sglang_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(sglang_engine)
    try:
        named = new_weights(sglang_engine, seed=5)
        assert trainer.sync(named, "fresh", "flattened_bucket").status_code == 200
    finally:
        trainer.close()
    out = generate(
        sglang_engine,
        input_ids=[3, 4, 5],
        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in named:
            params[name].copy_(t)
        logp = torch.log_softmax(model(input_ids=torch.tensor([[3, 4, 5]])).logits[0, -1], -1)
    first_logprob, first_token, _ = out["meta_info"]["output_token_logprobs"][0]
    assert first_token == int(logp.argmax())
    assert first_logprob == pytest.approx(float(logp.max()), abs=1e-4)
    assert out["meta_info"]["weight_version"] == "fresh"


# -- pause modes ---------------------------------------------------------------------------------
def _stream(engine, n_tokens: int):
    r = requests.post(
        f"{engine.url}/generate",
        json={
            "input_ids": [11, 12, 13],
            "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        },
        headers=engine.headers,
        stream=True,
        timeout=120,
    )
    assert r.status_code == 200
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[len(b"data: ") :])


def test_in_place_pause_and_update_mid_generation_reports_two_version_spans(sglang_engine):
    engine = sglang_engine
    before = model_info(engine)["weight_version"]
    trainer = Trainer(engine)
    try:
        chunks = _stream(engine, n_tokens=LONG)
        first = next(chunks)
        assert first["meta_info"]["finish_reason"] is None
        assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
        # in_place keeps the request running: SGLang refuses the flush the update asks for
        refused = trainer.sync(new_weights(engine, seed=6), "refused-flush", None)
        assert refused.status_code == 400
        assert "cache was not flushed" in refused.json()["message"]
        r = trainer.sync(new_weights(engine, seed=7), "mid-flight", None, flush_cache=False)
        assert r.status_code == 200, r.text
        assert post(engine, "/continue_generation").status_code == 200
        *_, last = chunks
    finally:
        trainer.close()
    meta = last["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    # the refused-flush update loaded its weights and moved the version too, but no token was
    # generated under it while paused: SGLang's spans leave out that zero-width span
    assert [s["version"] for s in meta["weight_versions"]] == [before, "mid-flight"]
    old_span, new_span = meta["weight_versions"]
    assert old_span["start"] == 0 and old_span["end"] == new_span["start"] >= 1
    assert new_span["end"] == LONG
    assert meta["weight_version"] == "mid-flight"


def test_retract_pause_allows_the_flush_and_counts_the_retraction(sglang_engine):
    engine = sglang_engine
    trainer = Trainer(engine)
    try:
        chunks = _stream(engine, n_tokens=LONG)
        next(chunks)
        assert post(engine, "/pause_generation", {"mode": "retract"}).status_code == 200
        r = trainer.sync(new_weights(engine, seed=8), "after-retract", "flattened_bucket")
        assert r.status_code == 200, r.text
        assert post(engine, "/flush_cache").status_code == 200
        assert post(engine, "/continue_generation").status_code == 200
        *_, last = chunks
    finally:
        trainer.close()
    meta = last["meta_info"]
    assert meta["num_retractions"] == 1
    assert meta["weight_versions"][-1]["version"] == "after-retract"
    assert meta["weight_versions"][-1]["end"] == LONG


def test_abort_pause_returns_partial_output(sglang_engine):
    engine = sglang_engine
    chunks = _stream(engine, n_tokens=LONG)
    seen = next(chunks)
    assert post(engine, "/pause_generation", {"mode": "abort"}).status_code == 200
    *_, last = chunks
    assert post(engine, "/continue_generation").status_code == 200
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(seen["output_ids"]) <= meta["completion_tokens"] < LONG


def test_get_weights_by_name_and_update_weight_version(sglang_engine):
    engine = sglang_engine
    current = engine.rank_weights()[0]["model.embed_tokens.weight"]
    r = post(
        engine, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2}
    )
    assert r.status_code == 200
    assert torch.tensor(r.json()).equal(current[:2])
    r = post(engine, "/update_weight_version", {"new_version": "renamed"})
    assert r.status_code == 200 and r.json()["new_version"] == "renamed"
    assert model_info(engine)["weight_version"] == "renamed"
    assert engine.rank_weight_versions() == ["renamed"]


def test_flush_is_refused_while_running_and_abort_request_ends_one_request(sglang_engine):
    engine = sglang_engine
    chunks = _stream(engine, n_tokens=LONG)
    rid = next(chunks)["meta_info"]["id"]
    assert post(engine, "/flush_cache").status_code == 400
    assert post(engine, "/abort_request", {"rid": rid}).status_code == 200
    *_, last = chunks
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(engine, "/flush_cache").status_code == 200


def test_batch_generate_and_health_generate(sglang_engine):
    outs = generate(
        sglang_engine,
        input_ids=[[1, 2, 3], [4, 5]],
        sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    assert all(len(o["output_ids"]) == 3 for o in outs)
    url = f"{sglang_engine.url}/health_generate"
    assert requests.get(url, timeout=60).status_code == 200


def test_sampling_follows_the_seed(sglang_engine):
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9},
        "return_logprob": True,
    }
    seeded = {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 11}}
    a, b = generate(sglang_engine, **seeded), generate(sglang_engine, **seeded)
    assert a["output_ids"] == b["output_ids"]
    assert all(lp <= 0.0 for lp, _, _ in a["meta_info"]["output_token_logprobs"])


def test_stop_ends_every_process_it_started(sglang_engine_factory):
    engine = sglang_engine_factory(tp_size=2, api_key="other-key")
    assert post(engine, "/begin_weight_update").status_code == 200
    assert post(engine, "/end_weight_update").status_code == 200
    assert len(engine.pids) == 3
    engine.stop()
    assert not any(proc.is_alive() for proc in engine._processes)


def test_load_errors_follow_sglangs_qwen2_loader(sglang_engine):
    """A wrong shape fails the call; a name the model lacks is skipped (SGLang only warns)."""
    engine = sglang_engine
    trainer = Trainer(engine)
    try:
        wrong_shape = [("model.norm.weight", torch.ones(32))]
        r = trainer.sync(wrong_shape, "bad-shape", None)
        assert r.status_code == 400
        assert r.json()["message"].startswith("Failed to update parameter online")
        r = trainer.sync([("model.no_such.weight", torch.ones(4))], "unknown-name", None)
        assert r.status_code == 200, r.text
        assert model_info(engine)["weight_version"] == "unknown-name"
    finally:
        trainer.close()


def test_routes_gone_in_0_5_23_are_404(sglang_engine):
    r = requests.get(
        f"{sglang_engine.url}/get_weight_version", headers=sglang_engine.headers, timeout=30
    )
    assert r.status_code == 404


def test_tp2_refused_flush_on_rank0_fails_the_call_and_spans_still_hold(sglang_engine_tp2):
    """TP rank 0 runs the request and refuses the flush, rank 1 is idle and flushes: the
    combined reply fails (success only if every rank succeeds), as SGLang answers from rank 0."""
    engine = sglang_engine_tp2
    before = model_info(engine)["weight_version"]
    trainer = Trainer(engine)
    try:
        chunks = _stream(engine, n_tokens=LONG)
        next(chunks)
        assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
        r = trainer.sync(new_weights(engine, seed=9), "tp2-mid-flight", "flattened_bucket")
        assert r.status_code == 400 and "cache was not flushed" in r.json()["message"]
        # the weights and version moved anyway, on both ranks; the tokenizer kept its version
        assert engine.rank_weight_versions() == ["tp2-mid-flight"] * 2
        assert model_info(engine)["weight_version"] == before
        assert post(engine, "/continue_generation").status_code == 200
        *_, last = chunks
    finally:
        trainer.close()
    spans = last["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == [before, "tp2-mid-flight"]
    assert spans[-1]["end"] == LONG
