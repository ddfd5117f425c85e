"""The gateway's pieces on their own: tool-call parsers per format, format detection, sessions and
keys, message checks, the template check, and the agent entrypoint loader."""

from __future__ import annotations

import json

import pytest

from fleetrl.models.tiny import build_tokenizer
from rollout_fleet.agents.entrypoint import AgentLoadError, load_agent
from rollout_fleet.gateway.episodes import SessionTable
from rollout_fleet.gateway.errors import ApiError
from rollout_fleet.gateway.messages import check_messages
from rollout_fleet.gateway.rendering import ChatRenderer, TemplateError
from rollout_fleet.gateway.tool_parsers import (
    UnknownToolFormat,
    detect_tool_format,
    parse_hermes,
    parse_llama3_json,
)


def test_hermes_calls_and_content():
    reply = parse_hermes(
        'Let me check.<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "f", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert reply.content == "Let me check." and not reply.malformed
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("calc", {"x": 1}),
        ("f", {"y": 2}),
    ]
    assert len({c.id for c in reply.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "calc", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "calc", "arguments": {}}',  # unclosed
    ],
)
def test_hermes_malformed_is_content(text):
    reply = parse_hermes(text)
    assert reply.malformed and reply.content == text and not reply.tool_calls


def test_llama3_json_calls():
    reply = parse_llama3_json('<|python_tag|>{"name": "calc", "parameters": {"e": "1+1"}}')
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("calc", {"e": "1+1"})]
    assert parse_llama3_json("The answer is 2").content == "The answer is 2"
    broken = parse_llama3_json('{"name": "calc", "parameters": ')
    assert broken.malformed and not broken.tool_calls


def test_tool_format_detection_and_refusal():
    assert detect_tool_format("... <tool_call> ...", "t") == "hermes"
    assert detect_tool_format("... <|python_tag|> ...", "t") == "llama3_json"
    with pytest.raises(UnknownToolFormat, match="rollout.agent.tool_format"):
        detect_tool_format(build_tokenizer().chat_template, "tiny")


def test_sessions_keys_are_per_episode_and_end():
    table = SessionTable()
    first, key1 = table.open("g/e0", "g", {"max_new_tokens": 8})
    second, key2 = table.open("g/e1", "g", {"max_new_tokens": 8})
    assert key1 != key2 and table.episode(key1) is first and table.episode(key2) is second
    assert key1 not in repr(table.__dict__)  # only digests are held
    for bad in (None, "", "nope"):
        with pytest.raises(ApiError) as err:
            table.episode(bad)
        assert err.value.status == 401
    table.close(first)
    with pytest.raises(ApiError) as err:
        table.episode(key1)
    assert err.value.code == "episode_ended"
    assert table.fail_all("restarted") == 1 and second.failure == "restarted"
    with pytest.raises(ApiError):
        table.episode(key2)


def test_messages_are_checked_with_their_position():
    messages = check_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
    ])  # fmt: skip
    assert messages[0].role == "system" and messages[0].content == "be brief"
    assert messages[1].template()["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    # ids and JSON spacing do not change what a message is
    again = check_messages([{"role": "assistant", "tool_calls": [
        {"id": "b", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])  # fmt: skip
    assert again[0].key == messages[1].key
    with pytest.raises(ApiError, match=r"messages\[1\].content\[0\]"):
        check_messages([{"role": "user", "content": "a"},
                        {"role": "user", "content": [{"type": "image_url"}]}])  # fmt: skip


def test_template_without_verbatim_content_is_refused():
    tokenizer = build_tokenizer()
    ChatRenderer(tokenizer).check_template()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    with pytest.raises(TemplateError, match="verbatim"):
        ChatRenderer(tokenizer).check_template()
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatRenderer(tokenizer).check_template()


def test_agent_entrypoint_from_a_file_or_module(tmp_path, monkeypatch):
    path = tmp_path / "my_agent.py"
    path.write_text("def run(base_url, api_key, sample):\n    return 1.0\n")
    assert load_agent(f"{path}:run")(base_url="", api_key="", sample={}) == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_agent("my_agent:run")(base_url="", api_key="", sample={}) == 1.0
    with pytest.raises(AgentLoadError, match="file not found"):
        load_agent(f"{tmp_path}/missing.py:run")
    with pytest.raises(AgentLoadError, match="has no function"):
        load_agent(f"{path}:other")
    path.write_text("def run(prompt):\n    return 1.0\n")
    with pytest.raises(AgentLoadError, match="base_url, api_key, sample"):
        load_agent(f"{path}:run")
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(AgentLoadError, match="fails to import"):
        load_agent(f"{path}:run")
