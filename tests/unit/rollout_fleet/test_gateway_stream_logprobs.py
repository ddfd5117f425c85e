"""The gateway's ``stream: true`` and ``top_logprobs`` with the ``openai`` package itself, over
scripted engines that stream SGLang's events token by token (``gateway_harness``): content
arrives while the engine is still generating, tool calls come as deltas the client's stream
helper assembles into the unstreamed call, the recorded tokens are the unstreamed call's, a
stream that fails midway continues elsewhere from the tokens it had sent, a call no engine
can finish ends its stream with an error the client raises, and top logprobs come back in
OpenAI's shapes, with OpenAI's refusals."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from fleetrl.models.chat_templates import TOOLS_TEMPLATE
from fleetrl.models.tiny import build_tokenizer
from rollout_fleet.gateway.streaming import ReplyStream
from rollout_fleet.gateway.tool_parsers import sendable_hermes
from tests.unit.rollout_fleet.gateway_harness import TOOLS, GatewayHarness, ScriptedEngine

LONG = "The quick brown fox jumps over the lazy dog, then naps in the warm sun."
CALL = 'Let me check.\n<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def start(tokenizer, reply):
    return GatewayHarness(tokenizer, [ScriptedEngine("e0", tokenizer, reply),
                                      ScriptedEngine("e1", tokenizer, reply)])  # fmt: skip


@pytest.fixture
def harness(tokenizer):
    started = start(tokenizer, lambda text: LONG)
    yield started
    started.close()


def client(harness, key):
    return openai.OpenAI(base_url=harness.base_url, api_key=key, max_retries=0, timeout=60)


def recorded(episode):
    (leaf,) = episode.leaves()
    p = leaf.progress
    return p.prompt_ids, p.output_ids, p.logprobs, p.token_versions, p.loss_mask


def test_content_streams_while_the_engine_generates_and_records_the_same_tokens(harness):
    plain_episode, plain_key = harness.open_episode("g0/plain")
    plain = client(harness, plain_key).chat.completions.create(model="m", messages=MESSAGES)
    for engine in harness.engines:
        engine.hold_at = 10  # each stream stops after 10 tokens until the test has read one
        engine.release.clear()
    episode, key = harness.open_episode("g0/streamed")
    chunks, seen_at_first_content = [], None
    stream = client(harness, key).chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        chunks.append(chunk)
        if seen_at_first_content is None and chunk.choices and chunk.choices[0].delta.content:
            seen_at_first_content = max(e.streamed for e in harness.engines)
            for engine in harness.engines:
                engine.release.set()
    total = plain.usage.completion_tokens
    assert seen_at_first_content is not None and seen_at_first_content <= 10 < total
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 2
    assert "".join(pieces) == plain.choices[0].message.content == LONG
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert recorded(episode)[1:] == recorded(plain_episode)[1:]


def test_tool_calls_stream_as_deltas_the_client_assembles(tokenizer):
    harness = start(tokenizer, lambda text: CALL)
    try:
        plain_episode, plain_key = harness.open_episode("g0/plain")
        plain = client(harness, plain_key).chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS
        )
        episode, key = harness.open_episode("g0/streamed")
        with client(harness, key).chat.completions.stream(
            model="m", messages=MESSAGES, tools=TOOLS
        ) as stream:
            contents = [e.delta for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
    finally:
        harness.close()
    want, got = plain.choices[0], final.choices[0]
    assert want.message.content == got.message.content == "Let me check."
    assert "".join(contents) == "Let me check." and len(contents) > 1  # none of the markup
    assert got.finish_reason == want.finish_reason == "tool_calls"
    (call,), (want_call,) = got.message.tool_calls, want.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        want_call.function.name,
        json.loads(want_call.function.arguments),
    )
    assert recorded(episode)[1:] == recorded(plain_episode)[1:]


def test_a_stream_that_fails_midway_goes_on_elsewhere_from_what_it_sent(harness, tokenizer):
    failed, resumed = harness.engines
    failed.fail_stream_after = 6  # the first engine a call is routed to fails after 5 tokens
    episode, key = harness.open_episode()
    chunks = list(client(harness, key).chat.completions.create(
        model="m", messages=MESSAGES, stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the piece that failed had streamed 5 tokens: the next engine continued after them
    (sent,) = failed.requests
    assert failed.fail_stream_after is None and len(resumed.requests) == 1
    streamed = failed.outputs[0][:5]
    assert resumed.requests[-1]["input_ids"] == sent["input_ids"] + streamed
    _, output_ids, _, _, _ = recorded(episode)
    assert output_ids[:5] == streamed
    assert text == tokenizer.decode(output_ids, skip_special_tokens=True)


def test_chat_top_logprobs_in_openais_shape_and_its_refusals(harness):
    episode, key = harness.open_episode()
    chat = client(harness, key).chat
    reply = chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=3)
    assert isinstance(reply, ChatCompletion)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # the scripted engine's sampled token is its most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].bytes == list(entry.token.encode())
    for bad, where in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"top_logprobs": 2}, "top_logprobs"),
                       ({"logprobs": True, "top_logprobs": -1}, "top_logprobs")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            chat.completions.create(model="m", messages=MESSAGES, **bad)
        assert err.value.status_code == 400 and err.value.param == where
        assert err.value.body["type"] == "invalid_request_error"


def test_completion_logprobs_k_in_openais_shape(harness, tokenizer):
    episode, key = harness.open_episode()
    api = client(harness, key)
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    reply = api.completions.create(model="m", prompt=prompt, max_tokens=200, logprobs=2)
    assert isinstance(reply, Completion)
    lp = reply.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == len(lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and top[token] == logprob == max(top.values())
    chunks = list(api.completions.create(model="m", prompt=prompt, max_tokens=200, stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == LONG
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="m", prompt=prompt, logprobs=6)
    assert err.value.param == "logprobs"


def test_a_call_refused_before_generating_is_a_plain_error_when_streamed(harness):
    _, key = harness.open_episode()
    with pytest.raises(openai.BadRequestError) as err:
        client(harness, key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * 600}], stream=True
        )
    assert err.value.code == "context_length_exceeded"


def test_deltas_hold_partial_characters_tool_markup_and_stop_starts():
    """Byte-level ids (one byte a token): a character split over tokens is sent whole, and
    nothing that may still be a tool call or a stop string is sent early."""
    stream = ReplyStream(chat=True, rid="r", model="m", n=1,
                         text_of=lambda ids: bytes(ids).decode("utf-8", errors="replace"),
                         sendable=sendable_hermes, stops=["END"], token_text=None,
                         include_usage=False)  # fmt: skip
    reply = "né 😀 ok <tool_call>{}</tool_call>".encode()
    sent = []
    for k in range(1, len(reply) + 1):
        sent += [e["choices"][0]["delta"]["content"] for e in stream.tokens(0, list(reply[:k]))]
    assert "".join(sent) == "né 😀 ok" and all("\ufffd" not in s for s in sent)
    assert len(sent) > 3
    stopped = ReplyStream(chat=False, rid="r", model="m", n=1,
                          text_of=lambda ids: bytes(ids).decode(), sendable=len, stops=["END"],
                          token_text=None, include_usage=False)  # fmt: skip
    texts = [e["choices"][0]["text"] for k in range(1, 9)
             for e in stopped.tokens(0, list(b"abcEN" + b"Dxx")[:k])]  # fmt: skip
    assert "".join(texts).startswith("abc") and "E" not in "".join(texts[:2])


def test_n_choices_stream_side_by_side_each_whole(harness):
    _, key = harness.open_episode()
    chunks = list(client(harness, key).chat.completions.create(
        model="m", messages=MESSAGES, n=2, stream=True, logprobs=True, top_logprobs=2))  # fmt: skip
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == LONG
        assert mine[-1].finish_reason == "stop"
        assert len(mine[-1].logprobs.content) == len(LONG) + 1  # a character a token, and the stop
        assert all(len(e.top_logprobs) == 2 for e in mine[-1].logprobs.content)


def test_a_call_that_fails_after_its_first_event_ends_the_stream_with_an_error(harness):
    for engine in harness.engines:  # every piece streams a token, then its engine fails
        engine.fail_stream_after, engine.stream_failures = 2, 100
    episode, key = harness.open_episode()
    stream = client(harness, key).chat.completions.create(model="m", messages=MESSAGES, stream=True)
    seen = []
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            seen.append(chunk)
    assert "no engine could serve this call" in err.value.message
    assert seen and seen[0].choices[0].delta.role == "assistant"
    assert "could not be served" in episode.failure  # nothing of it is trained
