"""A group's samples in one batched /generate (SampleRunner.generate_group): one request for n
fresh samples, outputs in order, the router's load counted per sample; a sample the batch left
unfinished (abort, a malformed output), a failed batch, or an engine without batches continue
one request per sample."""

from __future__ import annotations

import asyncio

from rollout_fleet.client import EngineClient, EngineError, generate_sample_sglang
from rollout_fleet.membership import Membership
from rollout_fleet.router import Router
from rollout_fleet.sample_runner import SampleRunner
from rollout_fleet.trajectory import ABORT, SampleProgress


def _reply(input_ids, n, *, token, finish="length", bad=False):
    logprobs = [[-0.25, token, None]] * (n - 1 if bad else n)
    return {
        "output_ids": [token] * n,
        "meta_info": {
            "finish_reason": {"type": finish},
            "weight_version": "3",
            "output_token_logprobs": logprobs,
            "prompt_tokens": len(input_ids),
        },
    }


class Engine:
    """SGLang's /generate format: a list of prompts gets a list of replies, in order."""

    generate_sample = generate_sample_sglang
    generate_batch = EngineClient.generate_batch  # the real client's batch call over generate

    def __init__(self, *, abort: int | None = None, bad: int | None = None, fail: bool = False):
        self.abort, self.bad, self.fail = abort, bad, fail
        self.bodies: list[dict] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, **extra):
        self.bodies.append({"input_ids": input_ids, "rid": rid, **sampling_params})
        n = sampling_params["max_new_tokens"]
        if not isinstance(input_ids[0], list):  # one sample
            return _reply(input_ids, n, token=9)
        if self.fail:
            raise EngineError("http://e", "/generate", 503, "overloaded")
        replies = []
        for i, ids in enumerate(input_ids):
            if i == self.abort:  # paused in abort mode after one token
                replies.append(_reply(ids, 1, token=10 + i, finish=ABORT))
            else:
                replies.append(_reply(ids, n, token=10 + i, bad=i == self.bad))
        return replies

    async def abort_request(self, rid=None, abort_all=False):
        return None


class SingleOnly(Engine):
    generate_batch = None  # vLLM's client: no batch call


def _run(engine, n=4, max_new_tokens=3):
    members = Membership()
    members.launch("e", "http://e")
    members.weights_loaded("e", 3)
    router = Router(members)
    runner = SampleRunner(router, {"e": engine}, max_attempts=3, retry_backoff_s=0.0)
    samples = [
        SampleProgress(prompt_ids=[1, 2, 3], max_new_tokens=max_new_tokens) for _ in range(n)
    ]
    uids = [f"g/{i}" for i in range(n)]
    asyncio.run(runner.generate_group("g", uids, samples, {"temperature": 1.0}))
    assert router._load["e"].outstanding == 0  # every lease handed back, per sample
    return runner, samples


def test_fresh_samples_go_as_one_batched_request_answered_in_order():
    engine = Engine()
    runner, samples = _run(engine)
    assert len(engine.bodies) == 1 and runner.requests_sent == 1
    body = engine.bodies[0]
    assert body["input_ids"] == [[1, 2, 3]] * 4 and body["max_new_tokens"] == 3
    assert body["rid"] == ["g/0.0.0", "g/1.0.0", "g/2.0.0", "g/3.0.0"]
    assert [s.output_ids for s in samples] == [[10 + i] * 3 for i in range(4)]
    assert all(s.finished and s.token_versions == [3, 3, 3] for s in samples)
    assert runner.tokens_generated == 12


def test_a_sample_the_batch_left_unfinished_continues_alone_from_its_tokens():
    engine = Engine(abort=1)
    runner, samples = _run(engine)
    assert [b["rid"] for b in engine.bodies[1:]] == ["g/1.1.0"]
    assert engine.bodies[1]["input_ids"] == [1, 2, 3, 11]
    assert engine.bodies[1]["max_new_tokens"] == 2
    assert samples[1].output_ids == [11, 9, 9] and samples[1].finished
    assert [s.output_ids for i, s in enumerate(samples) if i != 1] == [[10] * 3, [12] * 3, [13] * 3]
    assert runner.abort_resubmits == 1 and runner.engine_errors == 0


def test_a_failed_or_malformed_batch_or_an_engine_without_batches_runs_each_sample_alone():
    for engine in (Engine(fail=True), Engine(bad=2)):
        runner, samples = _run(engine)
        assert len(engine.bodies) == 5 and runner.engine_errors == 1
        assert all(s.output_ids == [9, 9, 9] for s in samples)
    engine = SingleOnly()
    runner, samples = _run(engine)
    assert len(engine.bodies) == 4 and runner.requests_sent == 4
    assert all(not isinstance(b["input_ids"][0], list) for b in engine.bodies)
