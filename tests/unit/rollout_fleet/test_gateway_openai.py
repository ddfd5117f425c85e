"""The agent gateway driven by the ``openai`` package itself (sync and async clients, tools,
streaming, its error classes) and by LangChain's ``ChatOpenAI``, every reply parsed with the
client's own types. Engines are scripted (``gateway_harness``): what is under test is the
OpenAI protocol, the sessions and the token record, on the real gateway over loopback HTTP."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from fleetrl.models.chat_templates import TOOLS_TEMPLATE
from fleetrl.models.tiny import build_tokenizer
from tests.unit.rollout_fleet.gateway_harness import TOOLS, GatewayHarness, ScriptedEngine

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'


def calculator_reply(text: str) -> str:
    return "The answer is 5" if "<tool_response>" in text else CALL


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture
def harness(tokenizer):
    engines = [ScriptedEngine("e0", tokenizer, calculator_reply),
               ScriptedEngine("e1", tokenizer, calculator_reply)]  # fmt: skip
    started = GatewayHarness(tokenizer, engines)
    yield started
    started.close()


def client(harness, key):
    return openai.OpenAI(base_url=harness.base_url, api_key=key, max_retries=0)


def tool_round_trip(chat, tools=TOOLS):
    messages = [{"role": "user", "content": "What is 2+3?"}]
    first = chat.completions.create(model="any", messages=messages, tools=tools)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    second = chat.completions.create(model="any", messages=messages, tools=tools)
    return first, second


def test_sync_client_tool_round_trip_records_one_trajectory(harness, tokenizer):
    episode, key = harness.open_episode()
    first, second = tool_round_trip(client(harness, key).chat)
    assert isinstance(first, ChatCompletion) and isinstance(second, ChatCompletion)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "calc"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    assert first.choices[0].message.content is None
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "The answer is 5"
    assert second.usage.completion_tokens == len("The answer is 5") + 1
    # one conversation: the second call extended the first, so one trajectory (leaf)
    (leaf,) = episode.leaves()
    progress = leaf.progress
    engine_outputs = [o for e in harness.engines for o in e.outputs]
    turn1, turn2 = engine_outputs
    ids = progress.output_ids
    assert ids[: len(turn1)] == turn1 and ids[-len(turn2) :] == turn2
    between = ids[len(turn1) : -len(turn2)]
    assert tokenizer.decode(between) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert progress.loss_mask == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    # the engine saw exactly the trajectory's ids before its second turn
    second_request = [r for e in harness.engines for r in e.requests][-1]
    assert second_request["input_ids"] == progress.prompt_ids + ids[: -len(turn2)]
    assert all(lp == 0.0 for lp in progress.logprobs[len(turn1) : -len(turn2)])
    assert progress.logprobs[0] == pytest.approx(-0.25)


def test_async_client_streams_content_and_tool_calls(harness):
    episode, key = harness.open_episode()

    async def main():
        chat = openai.AsyncOpenAI(base_url=harness.base_url, api_key=key, max_retries=0).chat
        messages = [{"role": "user", "content": "What is 2+3?"}]
        chunks = [c async for c in await chat.completions.create(
            model="any", messages=messages, tools=TOOLS, stream=True,
            stream_options={"include_usage": True})]  # fmt: skip
        plain = await chat.completions.create(model="any", messages=[
            {"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "hm"},
            {"role": "user", "content": "<tool_response>"}], stream=True)  # fmt: skip
        return chunks, [c async for c in plain]

    chunks, plain = asyncio.run(main())
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks + plain)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["calc"]
    assert json.loads(calls[0].function.arguments) == {"expression": "2+3"}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in plain if c.choices)
    assert text == "The answer is 5"
    # the rewritten history (no tool call in it) is a second trajectory of the episode
    assert len(episode.leaves()) == 2


def test_errors_come_back_as_the_openai_exceptions(harness):
    episode, key = harness.open_episode()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as err:
        client(harness, "wrong-key").chat.completions.create(model="m", messages=messages)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    chat = client(harness, key).chat
    with pytest.raises(openai.BadRequestError) as err:
        chat.completions.create(model="m", messages=messages, tool_choice="required", tools=TOOLS)
    assert err.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert "messages[0]" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 600}])
    assert err.value.code == "context_length_exceeded"
    harness.call(_close(harness, episode))
    with pytest.raises(openai.AuthenticationError) as err:
        chat.completions.create(model="m", messages=messages)
    assert err.value.code == "episode_ended"
    assert not episode.leaves()  # nothing was generated for a refused call


async def _close(harness, episode):
    harness.sessions.close(episode)


def test_completions_and_models(harness, tokenizer):
    episode, key = harness.open_episode()
    api = client(harness, key)
    assert [m.id for m in api.models.list().data] == ["policy"]
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    first = api.completions.create(model="m", prompt=prompt, max_tokens=200, logprobs=1)
    assert isinstance(first, Completion) and first.choices[0].text == CALL
    assert first.choices[0].logprobs.token_logprobs[0] == pytest.approx(-0.25)
    (leaf,) = episode.leaves()
    follow = leaf.ids + tokenizer.encode("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")
    second = api.completions.create(model="m", prompt=follow, max_tokens=200)
    assert second.choices[0].text == "The answer is 5"
    (extended,) = episode.leaves()  # token-prefix continuation: still one trajectory
    assert extended.progress.prompt_ids == prompt


def test_malformed_tool_json_comes_back_as_content(harness, tokenizer):
    bad = '<tool_call>{"name": "calc", "arguments": {"expression": </tool_call>'
    for engine in harness.engines:
        engine.reply = lambda text: bad
    episode, key = harness.open_episode()
    reply = client(harness, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
    )
    assert reply.choices[0].message.content == bad
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    assert harness.calls.malformed_tool_calls == 1 and episode.malformed_tool_calls == 1


def test_engine_failure_retries_elsewhere_with_the_same_ids(harness):
    for engine in harness.engines:
        engine.fail_next = 1  # whichever engine the episode is routed to first fails once
    episode, key = harness.open_episode()
    reply = client(harness, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is 2+3?"}], tools=TOOLS
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    requests = [r for e in harness.engines for r in e.requests]
    assert len(requests) >= 2
    assert all(r["input_ids"] == requests[0]["input_ids"] for r in requests)
    assert len(episode.leaves()) == 1 and not episode.failure


def test_langchain_chat_openai_calls_tools(harness):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    episode, key = harness.open_episode()
    model = ChatOpenAI(base_url=harness.base_url, api_key=key, model="policy", max_retries=0)
    bound = model.bind_tools(TOOLS)
    history = [HumanMessage("What is 2+3?")]
    first = bound.invoke(history)
    assert first.tool_calls[0]["name"] == "calc"
    assert first.tool_calls[0]["args"] == {"expression": "2+3"}
    history += [first, ToolMessage("5", tool_call_id=first.tool_calls[0]["id"])]
    second = bound.invoke(history)
    assert second.content == "The answer is 5"
    assert len(episode.leaves()) == 1  # LangChain's re-sent history extends the recorded turn
