"""Co-located mode against SGLang 0.5.23's own code: every request the cycle sends.

The engines run SGLang's HTTP app and tokenizer-side control code and, per TP rank, its
``SchedulerWeightUpdaterManager`` (release/resume by tag, the idle assertion, the
resume order, the update session) and model-runner ``WeightUpdater`` (SGLang's
``SafeUnpickler`` reading each rank's own payload entry, the flattened-bucket loader):
see ``sglang_engine``. Only the allocator under the tags is ours (``sglang_engine.memory``).

What passes here: ``TensorSender``'s payload (our pickler, SGLang's class names) loads
bit for bit on TP 1 and TP 2 engines and records the version; ``ColocatedEngines``'
pause -> release -> resume weights -> push -> resume KV -> continue never trips SGLang's
idle assertion and resumes in SGLang's order; the bodies our clients send are SGLang's
fields (its route would take a misspelled ``tags`` silently and release everything).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pydantic
import pytest
import requests

from rollout_fleet.client import EngineClient as RolloutClient
from rollout_fleet.colocation import ColocatedEngines
from rollout_fleet.config import ColocateConfig
from rollout_fleet.membership import EngineStatus, Membership, SyncOutcome
from tests.conformance.test_weight_sender import assert_every_rank_holds, learner_tensors
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineClient, EngineEndpoint
from weight_sync.tensor_push import TensorSender

pytestmark = pytest.mark.timeout(600)

ROUTING_FIELDS = {"rid", "http_worker_ipc"}  # BaseReq's: SGLang fills them, never a body


def _config() -> WeightSyncConfig:
    return WeightSyncConfig(bucket_mb=0.05, timeout_s=60, verify_tensors=1000, verify_rows=1000)


def _endpoint(engine, name: str) -> EngineEndpoint:
    return EngineEndpoint(name, engine.url, engine.api_key, world_size=engine.tp_size)


def test_pushes_by_handle_load_bit_for_bit_on_tp1_and_tp2_through_sglangs_updater(
    sglang_engine, sglang_engine_tp2, tiny_model_dir
):
    with TensorSender(_config(), tp_size=1) as tp1, TensorSender(_config(), tp_size=2) as tp2:
        tp1.set_members([_endpoint(sglang_engine, "tp1")])
        tp2.set_members([_endpoint(sglang_engine_tp2, "tp2")])
        for version in (1, 2):
            sent = learner_tensors(tiny_model_dir, 0.01 * version)
            for sender, engine in ((tp1, sglang_engine), (tp2, sglang_engine_tp2)):
                metrics = sender.publish(iter(sent), version)
                assert metrics.num_buckets > 1
                assert all(s.ok and s.verified for s in metrics.engines.values())
                assert_every_rank_holds(engine, sent, version)
                assert engine.rank_weight_versions() == [str(version)] * engine.tp_size


def test_sglang_refuses_a_tensor_update_outside_the_session(sglang_engine):
    body = {"serialized_named_tensors": ["AA=="], "load_format": "flattened_bucket"}
    reply = requests.post(
        f"{sglang_engine.url}/update_weights_from_tensor",
        json=body,
        headers=sglang_engine.headers,
        timeout=30,
    )
    assert reply.status_code == 400
    assert "must run between begin_weight_update() and end_weight_update()" in reply.text


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    """Wide enough that a long request is still running when the cycle pauses it (this
    engine recomputes the whole sequence for every token)."""
    from fleetrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("slow") / "model", layers=4, hidden=256)


async def _start_long_request(engine) -> asyncio.Future:
    """A 400-token request, returned once TP rank 0 runs it."""
    request = asyncio.ensure_future(asyncio.to_thread(_generate, engine, 400))
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(engine.rank_memory))[0].running == 0:
        assert time.monotonic() < deadline and not request.done(), "the request never ran"
        await asyncio.sleep(0.02)
    return request


def _generate(engine, tokens: int) -> dict:
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
    }
    return requests.post(
        f"{engine.url}/generate", json=body, headers=engine.headers, timeout=300
    ).json()


async def _cycle(engine, model_dir, pause_mode: str) -> tuple[list, dict, Membership]:
    """One co-located version on ``engine``: a request in flight, then the whole cycle."""
    membership = Membership()
    membership.launch("e", engine.url)
    membership.weights_loaded("e", 0)
    client = RolloutClient(engine.url, api_key=engine.api_key, timeout_s=120, retries=0)
    owner = ColocatedEngines(
        ColocateConfig(pause_mode=pause_mode), membership, lambda _: client, lambda _: True
    )
    in_flight = await _start_long_request(engine)
    assert await owner.yield_devices() == 1
    released = engine.rank_memory()
    assert membership.status("e") is EngineStatus.RELEASED
    await owner.prepare_push(["e"])
    sent = learner_tensors(model_dir, 0.3)
    with TensorSender(_config(), tp_size=engine.tp_size) as sender:
        sender.set_members([_endpoint(engine, "e")])
        await asyncio.to_thread(sender.publish, iter(sent), 1)
    target = membership.weight_targets().engines
    outcome = await owner.take_back(SyncOutcome(version=1, targets=target))
    membership.apply_sync(outcome)
    first = await in_flight
    await client.close()
    return released, {"first": first, "sent": sent, "owner": owner}, membership


@pytest.mark.parametrize("pause_mode", ["abort", "retract"])
def test_the_cycle_releases_and_resumes_in_sglangs_order_without_tripping_its_assertion(
    sglang_engine_factory, slow_model_dir, pause_mode
):
    engine = sglang_engine_factory(tp_size=2, model_dir=slow_model_dir)
    released, out, membership = asyncio.run(_cycle(engine, slow_model_dir, pause_mode))
    for rank in released:  # while the learner steps
        assert rank.offload_tags == ["cuda_graph", "kv_cache", "weights"]
        assert rank.calls == ["pause:kv_cache", "pause:weights", "pause:cuda_graph"]
        assert rank.weight_bytes == 0 and rank.errors == []
    for rank in engine.rank_memory():  # after the push and take_back
        assert rank.offload_tags == [] and rank.errors == []
        assert rank.calls[3:] == ["resume:cuda_graph", "resume:weights", "resume:kv_cache"]
    assert membership.status("e") is EngineStatus.READY
    assert_every_rank_holds(engine, out["sent"], 1)
    first = out["first"]
    if pause_mode == "abort":  # its partial came back, to be resubmitted by the worker
        assert first["meta_info"]["finish_reason"]["type"] == "abort"
    else:  # it waited in the queue and finished on the new weights
        assert first["meta_info"]["finish_reason"]["type"] == "length"
        assert first["meta_info"]["num_retractions"] >= 1
    assert out["owner"].metrics()["colocate/engines_released"] == 1.0
    assert _generate(engine, 2)["meta_info"]["weight_version"] == "1"


def test_sglang_asserts_idle_and_fails_a_resume_of_a_tag_never_released(
    sglang_engine_factory, slow_model_dir
):
    """What our cycle avoids (by pausing first, and by resuming only what it released): in a
    real server each of these kills the scheduler process."""
    engine = sglang_engine_factory(tp_size=1, model_dir=slow_model_dir)
    url, headers = engine.url, engine.headers
    busy = asyncio.run(_release_while_generating(engine))
    assert any("only when server is idle" in e for e in busy[0].errors)
    requests.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]}, headers=headers)
    (rank,) = engine.rank_memory()
    assert any("ResumeMemoryOccupationReqInput: KeyError" in e for e in rank.errors)


async def _release_while_generating(engine) -> list:
    request = await _start_long_request(engine)
    await asyncio.to_thread(
        requests.post,
        f"{engine.url}/release_memory_occupation",
        json={"tags": ["kv_cache"]},
        headers=engine.headers,
        timeout=60,
    )
    await request
    return engine.rank_memory()


def test_sglang_takes_a_misspelled_tags_key_silently_and_releases_everything(
    sglang_engine_factory,
):
    """Why the bodies below are checked against SGLang's fields: its route ignores
    unknown keys, so ``{"tag": ["kv_cache"]}`` is a release of every tag."""
    engine = sglang_engine_factory(tp_size=1)
    requests.post(f"{engine.url}/pause_generation", json={"mode": "abort"}, headers=engine.headers)
    reply = requests.post(
        f"{engine.url}/release_memory_occupation",
        json={"tag": ["kv_cache"]},
        headers=engine.headers,
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json() is None
    (rank,) = engine.rank_memory()
    assert rank.offload_tags == ["cuda_graph", "kv_cache", "weights"] and rank.weight_bytes == 0
    requests.post(f"{engine.url}/resume_memory_occupation", json={}, headers=engine.headers)


def test_every_body_our_clients_send_for_this_mode_is_sglangs(monkeypatch):
    from sglang.srt.managers import io_struct as io

    sent: list[tuple[str, dict]] = []

    async def record(self, method, endpoint, body=None, **_):
        sent.append((endpoint, body))
        return None

    monkeypatch.setattr(RolloutClient, "_request", record)
    monkeypatch.setattr(
        EngineClient, "call", lambda self, path, payload=None, **_: sent.append((path, payload))
    )
    rollout = RolloutClient("http://127.0.0.1:1")
    asyncio.run(rollout.release_memory_occupation(["kv_cache", "weights", "cuda_graph"]))
    asyncio.run(rollout.resume_memory_occupation(["cuda_graph", "weights"]))
    asyncio.run(rollout.resume_memory_occupation(["kv_cache"]))
    asyncio.run(rollout.pause_generation("abort"))
    asyncio.run(rollout.continue_generation())
    weights = EngineClient(EngineEndpoint("e", "http://127.0.0.1:1"), timeout_s=1)
    weights.update_weights_from_tensor(["AA=="], load_format="flattened_bucket", weight_version="3")
    weights.begin_update()
    weights.end_update()
    structs = {
        "/release_memory_occupation": io.ReleaseMemoryOccupationReqInput,
        "/resume_memory_occupation": io.ResumeMemoryOccupationReqInput,
        "/pause_generation": io.PauseGenerationReqInput,
        "/continue_generation": io.ContinueGenerationReqInput,
        "/update_weights_from_tensor": io.UpdateWeightsFromTensorReqInput,
        "/begin_weight_update": io.BeginWeightUpdateReqInput,
        "/end_weight_update": io.EndWeightUpdateReqInput,
    }
    for path, body in sent:
        struct = structs[path]
        fields = {f.name for f in msgspec.structs.fields(struct)} - ROUTING_FIELDS
        assert set(body) <= fields, (path, set(body) - fields)
        parsed = pydantic.TypeAdapter(struct).validate_python(body)
        for key, value in body.items():
            if key != "serialized_named_tensors":
                assert getattr(parsed, key) == value, (path, key)
    tensor = next(b for p, b in sent if p == "/update_weights_from_tensor")
    parsed = pydantic.TypeAdapter(io.UpdateWeightsFromTensorReqInput).validate_python(tensor)
    assert parsed.serialized_named_tensors == [b"\x00"]  # base64 over HTTP, as SGLang decodes it
    assert parsed.flush_cache is False and parsed.weight_version == "3"
