"""The gateway's top logprobs and streaming on a real embedded engine (tiny model, loopback),
driven by the ``openai`` client: top logprobs are the k largest of the distribution the token
was sampled from (greedy: the sampled token first, with the same logprob); a streamed greedy
reply arrives in many pieces while the engine is still generating, equals the unstreamed
reply, and records the same tokens."""

from __future__ import annotations

import threading

import openai
import pytest

from rollout_fleet.client import EngineClient
from tests.unit.rollout_fleet.gateway_harness import GatewayHarness

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture
def gateway(engine, tokenizer):
    started = []

    def start(temperature: float) -> GatewayHarness:
        client = EngineClient(engine.base_url)
        client.name = "e0"  # the harness registers engines by name and URL
        harness = GatewayHarness(tokenizer, [client], temperature=temperature, tool_format="none",
                                 max_new_tokens=200)  # fmt: skip
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.close()


def chat(harness, key):
    return openai.OpenAI(base_url=harness.base_url, api_key=key, max_retries=0, timeout=120).chat


@pytest.mark.parametrize(("temperature", "k"), [(0.0, 5), (1.0, 20)])
def test_top_logprobs_are_the_largest_of_the_sampling_distribution(gateway, temperature, k):
    harness = gateway(temperature)
    _, key = harness.open_episode()
    reply = chat(harness, key).completions.create(
        model="m", messages=MESSAGES, max_tokens=32, logprobs=True, top_logprobs=k, seed=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    found = 0
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == k
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        if temperature == 0.0:  # greedy: the sampled token is the most likely
            assert (tops[0].token, tops[0].logprob) == (entry.token, entry.logprob)
        same = [t for t in tops if t.token == entry.token]
        if same:  # the sampled token among the top k: the same logprob in both lists
            found += 1
            assert same[0].logprob == entry.logprob
        else:
            assert entry.logprob <= tops[-1].logprob
    assert found > 0


def test_a_streamed_reply_comes_while_generating_and_equals_the_unstreamed(gateway, engine):
    harness = gateway(0.0)
    plain_episode, plain_key = harness.open_episode("g0/plain")
    plain = chat(harness, plain_key).completions.create(
        model="m", messages=MESSAGES, max_tokens=120
    )
    # the engine stops after 20 more tokens until the test has read a content chunk
    read, start = threading.Event(), engine.scheduler.stats["generated_tokens"]

    def hold() -> None:
        if engine.scheduler.stats["generated_tokens"] - start >= 20:
            read.wait(30)

    engine.scheduler.add_delivery_hook(hold)
    episode, key = harness.open_episode("g0/streamed")
    pieces, generated_at_first = [], None
    for chunk in chat(harness, key).completions.create(
        model="m", messages=MESSAGES, max_tokens=120, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if generated_at_first is None:
                generated_at_first = engine.scheduler.stats["generated_tokens"] - start
                read.set()
    assert plain.usage.completion_tokens > 20  # the tiny model's greedy story is long enough
    assert generated_at_first is not None and generated_at_first <= 21
    assert len(pieces) > 2 and "".join(pieces) == plain.choices[0].message.content

    def record(ep):
        (leaf,) = ep.leaves()
        p = leaf.progress
        return p.output_ids, p.logprobs, p.token_versions

    assert record(episode) == record(plain_episode)
