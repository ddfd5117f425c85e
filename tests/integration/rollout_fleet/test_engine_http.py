"""The embedded engine over HTTP (EngineClient -> aiohttp -> scheduler thread): continuous
batching, pause modes, aborts, in-place weight updates, auth, and bad input."""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch

from rollout_fleet.client import EngineClient, EngineError, parse_generate_response
from rollout_fleet.engine.http_service import EngineStartupError, resolve_api_key
from rollout_fleet.engine.server import EmbeddedEngine

LONG = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
PROMPT = [5, 6, 7, 8, 9]


class FakeReceiver:
    """Stands in for weight_sync.receiver.WeightReceiver: 'receives' tensors it was given."""

    def __init__(self) -> None:
        self.groups: set[str] = set()
        self.next_update: list[tuple[str, torch.Tensor]] = []

    def init_group(
        self,
        master_address,
        master_port,
        rank_offset,
        world_size,
        group_name,
        backend,
        timeout_s=60,
    ):
        self.groups.add(group_name)

    def receive(self, names, dtypes, shapes, group_name, load_format, load=None):
        if group_name not in self.groups:
            raise ValueError(f"group {group_name!r} is not initialised")
        return self.next_update if load is None else load(self.next_update)

    def destroy(self, group_name):
        self.groups.discard(group_name)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    receiver = FakeReceiver()
    eng = EmbeddedEngine(
        tiny_model_dir,
        engine_id="http-test",
        max_running_requests=8,
        receiver_factory=lambda: receiver,
    )
    eng.fake_receiver = receiver
    eng.start_server()
    yield eng
    eng.stop()


def run(coro):
    return asyncio.run(coro)


def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=10**6,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


async def wait_running(client: EngineClient, engine: EmbeddedEngine, count: int = 1) -> None:
    for _ in range(5000):
        live = [s for s in engine.scheduler.running if not s.finished]
        if len(live) >= count and all(len(s.output_ids) >= 2 for s in live):
            return
        await asyncio.sleep(0.002)
    raise AssertionError("request never started running")


def test_short_request_finishes_while_a_long_one_is_still_decoding(engine):
    async def scenario():
        async with EngineClient(engine.base_url) as client:
            long_task = asyncio.create_task(client.generate(PROMPT, LONG))
            await wait_running(client, engine)
            short = await client.generate(
                [10, 11], {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
            )
            long_done_when_short_returned = long_task.done()
            long = await long_task
            return short, long, long_done_when_short_returned

    short, long, long_was_done = run(scenario())
    assert not long_was_done
    assert len(short["output_ids"]) == 4 and len(long["output_ids"]) == 200


def test_pause_abort_returns_partial_output_with_abort_finish_reason(engine):
    async def scenario():
        async with EngineClient(engine.base_url) as client:
            task = asyncio.create_task(client.generate(PROMPT, LONG, rid="to-abort"))
            await wait_running(client, engine)
            await client.pause_generation("abort")
            result = await task
            await client.continue_generation()
            return result

    out = parse_generate_response(run(scenario()))
    assert out.finish_reason == "abort"
    assert 0 < len(out.output_ids) < 200
    assert len(out.logprobs) == len(out.token_versions) == len(out.output_ids)
    assert out.rid == "to-abort"


def test_abort_request_by_rid_ends_only_that_request(engine):
    async def scenario():
        async with EngineClient(engine.base_url) as client:
            a = asyncio.create_task(client.generate(PROMPT, LONG, rid="victim"))
            b = asyncio.create_task(
                client.generate([9, 8, 7], {**LONG, "max_new_tokens": 60}, rid="bystander")
            )
            await wait_running(client, engine, 2)
            await client.abort_request(rid="victim")
            return await a, await b

    victim, bystander = run(scenario())
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert bystander["meta_info"]["finish_reason"]["type"] == "length"


def test_retract_frees_kv_then_continues_with_the_exact_greedy_continuation(engine):
    async def scenario():
        async with EngineClient(engine.base_url) as client:
            task = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 60}))
            await wait_running(client, engine)
            await client.pause_generation("retract")
            state = (await client.get_server_info())["internal_states"][0]
            flushed = await client.flush_cache()  # allowed: no request holds KV
            await client.continue_generation()
            return await task, state, flushed

    result, state, flushed = run(scenario())
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
    assert state["kv_cache_bytes"] == 0
    assert "flushed" in flushed.lower()
    assert result["output_ids"] == hf_greedy(engine.runner.model, PROMPT, 60)


def test_in_place_pause_keeps_kv_and_tags_tokens_after_a_weight_update(engine):
    weights = engine.runner.named_weights()
    same = [
        (name, weights[name].detach().clone()) for name in ("model.norm.weight", "lm_head.weight")
    ]
    engine.fake_receiver.next_update = same

    async def scenario():
        async with EngineClient(engine.base_url) as client:
            await client.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=29999,
                rank_offset=1,
                world_size=2,
                group_name="g",
                backend="gloo",
            )
            task = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 80}))
            await wait_running(client, engine)
            await client.pause_generation("in_place")
            steps = engine.scheduler.stats["decode_steps"]
            with pytest.raises(EngineError) as flush_err:
                await client.flush_cache()
            await client.begin_weight_update()
            reply = await client.update_weights_from_distributed(
                names=[n for n, _ in same],
                dtypes=["float32"] * 2,
                shapes=[list(t.shape) for _, t in same],
                group_name="g",
                weight_version="1",
            )
            await client.end_weight_update()
            await asyncio.sleep(0.05)
            steps_while_paused = engine.scheduler.stats["decode_steps"] - steps
            version = await client.get_weight_version()
            await client.continue_generation()
            result = await task
            await client.destroy_weights_update_group("g")
            return result, reply, flush_err.value, steps_while_paused, version

    result, reply, flush_err, steps_while_paused, version = run(scenario())
    assert reply["success"] is True and version == "1"
    assert flush_err.status == 400
    assert steps_while_paused == 0
    spans = result["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]  # SGLang 0.5.23's per-token spans
    versions = parse_generate_response(result).token_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    # Same weights loaded in place: the continuation is unchanged, the KV was kept.
    assert result["output_ids"] == hf_greedy(engine.runner.model, PROMPT, 80)
    assert result["meta_info"]["weight_version"] == "1"


def test_weight_update_with_unknown_name_fails_cleanly_and_changes_nothing(engine):
    engine.fake_receiver.next_update = [("model.not_a_param", torch.zeros(2))]
    before = {k: v.clone() for k, v in engine.runner.model.state_dict().items()}
    version_before = engine.scheduler.weight_version

    async def scenario():
        async with EngineClient(engine.base_url) as client:
            await client.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=29999,
                rank_offset=1,
                world_size=2,
                group_name="g2",
                backend="gloo",
            )
            await client.begin_weight_update()
            with pytest.raises(EngineError) as err:
                await client.update_weights_from_distributed(
                    names=["model.not_a_param"],
                    dtypes=["float32"],
                    shapes=[[2]],
                    group_name="g2",
                    weight_version="99",
                )
            await client.end_weight_update()
            await client.destroy_weights_update_group("g2")
            return err.value

    err = run(scenario())
    assert err.status == 400 and "not_a_param" in err.message
    after = engine.runner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.scheduler.weight_version == version_before


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b"{not json", "malformed"),
        (
            {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
            "sampling_params.temperature",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"tempature": 1.0}}, "tempature"),
        ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
        ({"input_ids": [1, 10**6]}, "vocabulary"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1, [2]]}, "mix"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**5}}, "context length"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_malformed_generate_bodies_get_400_naming_the_field_and_server_stays_up(
    engine, body, names
):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    resp = requests.post(engine.base_url + "/generate", timeout=30, **kwargs)
    assert resp.status_code == 400
    assert names in resp.json()["error"]["message"]
    assert requests.get(engine.base_url + "/health", timeout=10).status_code == 200


def test_streaming_sends_cumulative_sse_chunks_then_done(engine):
    resp = requests.post(
        engine.base_url + "/generate",
        stream=True,
        timeout=30,
        json={
            "input_ids": PROMPT,
            "stream": True,
            "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True},
        },
    )
    events = [line for line in resp.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    import json

    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[0]["meta_info"]["finish_reason"] is None


def test_api_key_is_enforced_when_required(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("FLEETRL_API_KEY", raising=False)
    with pytest.raises(EngineStartupError, match="API key"):
        resolve_api_key("0.0.0.0", None)
    assert resolve_api_key("127.0.0.1", None) is None
    with pytest.raises(EngineStartupError, match="FLEETRL_API_KEY"):  # `fleetrl engine`
        resolve_api_key("127.0.0.1", None, require_api_key=True)
    monkeypatch.setenv("FLEETRL_API_KEY", "from-env")
    assert resolve_api_key("0.0.0.0", None) == "from-env"
    monkeypatch.delenv("FLEETRL_API_KEY")
    eng = EmbeddedEngine(tiny_model_dir, engine_id="auth", api_key="s3cret", require_api_key=True)
    try:
        url = eng.start_server()
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert requests.post(url + "/generate", json=body, timeout=30).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert (
            requests.post(url + "/generate", json=body, headers=bad, timeout=30).status_code == 401
        )
        assert requests.get(url + "/get_model_info", timeout=30).status_code == 401
        assert requests.get(url + "/health", timeout=30).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert (
            requests.post(url + "/generate", json=body, headers=good, timeout=30).status_code == 200
        )

        async def with_client():
            async with EngineClient(url, api_key="s3cret") as client:
                return await client.get_model_info()

        assert run(with_client())["is_generation"] is True
    finally:
        eng.stop()
    no_key = EmbeddedEngine(tiny_model_dir, engine_id="nokey", require_api_key=True)
    try:
        with pytest.raises(EngineStartupError):
            no_key.start_server()
    finally:
        no_key.stop()
