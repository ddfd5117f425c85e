"""Bad input to the vLLM pieces is refused in one line naming what is wrong: sampling
parameters vLLM is not sent, a reply that is not a completion, a server spec without the
run's key or with a key on the command line, dev mode turned off, a server with no key.
What vLLM itself parses and answers is in the conformance tier (tests/conformance/vllm)."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.vllm_auth import RequireBearerKey
from rollout_fleet.vllm_client import completion_request, parse_completion
from rollout_fleet.vllm_launcher import VllmServerSpec, build_command, dev_mode_problem, server_env


def test_the_completion_body_carries_sglang_style_sampling_under_vllms_names():
    body = completion_request([1, 2], {"max_new_tokens": 5, "temperature": 0.7}, rid="u.0.0")
    assert (body["prompt"], body["max_tokens"], body["temperature"], body["request_id"]) == ([1, 2], 5, 0.7, "u.0.0")  # fmt: skip
    with pytest.raises(ValueError, match=r"sampling parameters vLLM is not sent: \['min_p'\]"):
        completion_request([1], {"min_p": 0.1})


def test_top_logprobs_ask_vllm_for_k_by_token_id_and_come_back_as_the_k_largest():
    body = completion_request([1, 2], {"max_new_tokens": 2}, top_logprobs=2)
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert completion_request([1], {})["logprobs"] == 0  # the sampled token's only
    # vLLM's CompletionLogProbs with return_tokens_as_token_ids: keys "token_id:<id>"
    # (format_token_id_placeholder); the sampled token first, then the k most likely
    top = [{"token_id:9": -3.0, "token_id:4": -0.5, "token_id:7": -1.0},
           {"token_id:4": -0.2, "token_id:8": -2.0}]  # fmt: skip
    reply = {"choices": [{"token_ids": [9, 4], "finish_reason": "length",
                          "logprobs": {"token_logprobs": [-3.0, -0.2], "top_logprobs": top}}]}  # fmt: skip
    out = parse_completion(reply, "r", top_logprobs=2)
    assert out.top_logprobs == [[(-0.5, 4), (-1.0, 7)], [(-0.2, 4), (-2.0, 8)]]
    assert parse_completion(reply, "r").top_logprobs == []


def test_a_reply_that_is_not_a_completion_is_named():
    with pytest.raises(ValueError, match="not a vLLM completion reply"):
        parse_completion({"choices": [{"text": "x"}]})
    reply = {"choices": [{"token_ids": [3, 4], "logprobs": {"token_logprobs": [-0.1]}}]}
    with pytest.raises(ValueError, match="1 logprobs for 2 output tokens"):
        parse_completion(reply)


def test_a_spec_needs_the_runs_key_and_keeps_it_off_the_command_line():
    with pytest.raises(ValueError, match="needs the run's api_key"):
        VllmServerSpec(model_path="/m", api_key="").validate()
    spec = VllmServerSpec(model_path="/m", api_key="k", port=8000, extra_args=["--api-key", "k"])
    with pytest.raises(ValueError, match="never on its command line"):
        build_command(spec)
    spec.extra_args = []
    assert "k" not in build_command(spec) and server_env(spec, base={})["VLLM_API_KEY"] == "k"


def test_dev_mode_turned_off_is_one_line_naming_the_routes_it_removes():
    assert dev_mode_problem({}) == "" and dev_mode_problem({"VLLM_SERVER_DEV_MODE": "true"}) == ""
    line = dev_mode_problem({"VLLM_SERVER_DEV_MODE": "0"})
    assert line.startswith("VLLM_SERVER_DEV_MODE=0") and "/update_weights" in line
    assert server_env(VllmServerSpec(model_path="/m", api_key="k"), base={})["VLLM_SERVER_DEV_MODE"] == "1"  # fmt: skip


def test_the_middleware_refuses_to_start_without_a_key_and_answers_401_without_it(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        RequireBearerKey(lambda *a: None)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    guard = RequireBearerKey(app)
    asyncio.run(guard({"type": "http", "path": "/pause", "headers": [(b"authorization", b"Bearer nope")]}, None, send))  # fmt: skip
    assert reached == [] and sent[0]["status"] == 401
    asyncio.run(guard({"type": "http", "path": "/pause", "headers": [(b"authorization", b"Bearer secret")]}, None, send))  # fmt: skip
    assert reached == ["/pause"]
