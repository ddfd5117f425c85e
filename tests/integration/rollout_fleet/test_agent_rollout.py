"""Agent programs as the rollout on a real embedded engine (tiny model, loopback), through the
gateway, with the real ``openai`` client: groups of episodes become trajectories with the
episode's reward; agents that raise, hang, return NaN or never call the model fail their
episode, counted, and nothing of it is sent (0 lost, 0 duplicated); a group trains without
its failed episodes; an agent in a subprocess trains the same way; a gateway that stops
answering is restarted and its episodes in flight fail, counted; a weight update inside a
call tags the call's tokens with both versions."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import openai
import pytest

from fleetrl.data.reader import PromptItem, render_prompt
from rollout_fleet.agents.config import AgentConfig
from rollout_fleet.agents.rollout import AgentRollout
from rollout_fleet.gateway.tool_parsers import UnknownToolFormat
from tests.integration.rollout_fleet.test_worker_embedded import (
    MidwayAction,
    abort_and_update,
    make_worker,
    run_then_close,
)

MODULE = __name__
_lock = threading.Lock()
_flaky_seen: set[str] = set()
called = threading.Event()
release = threading.Event()


def _chat(client, messages, max_tokens=6):
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
    return reply.choices[0].message.content or ""


def _client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def two_calls(base_url, api_key, sample):
    """Two turns; a fault chosen by the prompt's text."""
    text = sample["prompt"][0]["content"]
    if text.startswith("raise"):
        raise RuntimeError("the agent crashed")
    if text.startswith("hang"):
        time.sleep(10)
    if text.startswith("nan"):
        return float("nan")
    if text.startswith("silent"):
        return 1.0
    if text.startswith("flaky"):
        with _lock:
            first = text not in _flaky_seen
            _flaky_seen.add(text)
        if first:
            raise RuntimeError("the first episode of this prompt crashes")
    client = _client(base_url, api_key)
    messages = list(sample["prompt"])
    messages.append({"role": "assistant", "content": _chat(client, messages)})
    messages.append({"role": "user", "content": "again"})
    second = _chat(client, messages)
    return float(len(second) % 2)


async def async_unscored(base_url, api_key, sample):
    """One async call; the run's reward pipeline scores the reply."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="p", messages=sample["prompt"], max_tokens=12)
    return None


SUBPROCESS_AGENT = """
import json, sys
import openai
base_url, api_key, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
reply = client.chat.completions.create(model="policy", messages=prompt, max_tokens=5)
print(json.dumps({"reward": len(reply.choices[0].message.content) / 10}))
"""


def in_subprocess(base_url, api_key, sample):
    """The agent is another process: it gets the episode's base_url and key on its command line."""
    done = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_AGENT, base_url, api_key, json.dumps(sample["prompt"])],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])["reward"]


def waits_for_release(base_url, api_key, sample):
    client = _client(base_url, api_key)
    _chat(client, sample["prompt"])
    called.set()
    release.wait(30)
    _chat(client, sample["prompt"] + [{"role": "user", "content": "more"}])
    return 1.0


def one_long_call(base_url, api_key, sample):
    _chat(_client(base_url, api_key), sample["prompt"], max_tokens=24)
    return 1.0


def items(tokenizer, texts):
    out = []
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text}]
        ids = np.asarray(render_prompt(tokenizer, messages, True), dtype=np.int32)
        out.append(PromptItem(i, ids, "synth/parity", "0", {"i": i}, messages))
    return out


def agent_worker(engines, tokenizer, texts, agent, *, n=2, timeout_s=30.0, health_s=5.0, **cfg):
    config = AgentConfig(entrypoint=f"{MODULE}:{agent}", tool_format="none", timeout_s=timeout_s,
                         health_check_interval_s=health_s, max_concurrency=8)  # fmt: skip
    worker, _, sink = make_worker(engines, tokenizer, n=n, items=items(tokenizer, texts),
                                  max_new_tokens=64, agent=config,
                                  worker_options={"max_prompt_tokens": 64}, **cfg)  # fmt: skip
    return worker, sink


def test_agent_groups_train_on_their_episodes_and_faults_fail_only_theirs(engines, tokenizer):
    texts = ["ok 0", "ok 1", "raise 2", "hang 3", "nan 4", "silent 5", "flaky 6"]
    worker, sink = agent_worker(engines(1), tokenizer, texts, "two_calls", timeout_s=6.0)
    run_then_close(worker, worker.run(num_groups=len(texts)))
    by_group = Counter(t.group_id for t in sink.trajectories)
    prompts = {t.group_id: t.prompt_index for t in sink.trajectories}
    assert sorted(prompts.values()) == [0, 1, 6]  # the ok groups and the flaky one's survivor
    assert sorted(by_group.values()) == [1, 2, 2]
    assert len({t.uid for t in sink.trajectories}) == len(sink.trajectories)  # 0 duplicated
    assert len({t.episode for t in sink.trajectories}) == len(sink.trajectories)
    for t in sink.trajectories:
        t.validate()
        assert t.group_size == by_group[t.group_id] and t.episode.startswith(t.group_id + "/e")
        mask = t.loss_mask.numpy()
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1  # two generated turns, a user turn
        assert t.score in (0.0, 1.0) and t.reward_metrics["agent_reward"] == t.score
        text = items(tokenizer, texts)[t.prompt_index]
        assert t.prompt_ids.numpy().tolist() == text.prompt_ids.tolist()
    m = worker.metrics()
    assert m["rollout/groups_failed"] == 4  # raise, hang, nan, silent: every episode failed
    assert m["agent/episodes"] == 14 and m["agent/episodes_failed"] == 9
    assert m["agent/episodes_failed/raised"] == 3 and m["agent/episodes_failed/timeout"] == 2
    assert m["agent/episodes_failed/bad_reward"] == 2 and m["agent/episodes_failed/no_calls"] == 2
    assert m["agent/gateway_calls"] == 2 * 5  # two calls per episode that ran


def test_async_agent_is_scored_by_the_reward_pipeline(engines, tokenizer):
    worker, sink = agent_worker(engines(1), tokenizer, ["a", "b"], "async_unscored", n=3)
    run_then_close(worker, worker.run(num_groups=2))
    assert len(sink.trajectories) == 6
    for t in sink.trajectories:
        # parity_reward (the pipeline's function) on the decoded last reply
        assert "agent_reward" not in t.reward_metrics and t.score in (0.0, 1.0)
        assert t.loss_mask is None  # one generated turn: every response token trained


def test_agent_in_a_subprocess_trains_like_any_other(engines, tokenizer):
    # generous: a fresh interpreter importing openai takes seconds, more on a loaded machine
    worker, sink = agent_worker(engines(1), tokenizer, ["p 0"], "in_subprocess", n=1,
                                timeout_s=240.0)  # fmt: skip
    run_then_close(worker, worker.run(num_groups=1))
    assert len(sink.trajectories) == 1
    assert all(0.0 <= t.score <= 0.5 and len(t.response_ids) <= 5 for t in sink.trajectories)


def test_a_gateway_that_stops_answering_is_restarted_and_its_episodes_fail(engines, tokenizer):
    called.clear()
    release.clear()
    worker, sink = agent_worker(engines(1), tokenizer, ["wait"], "waits_for_release", health_s=0.2)

    async def scenario():
        task = asyncio.create_task(worker.run(num_groups=1))
        await asyncio.to_thread(called.wait, 30)
        gateway = worker.agents.agents.gateway
        await gateway.stop()  # the gateway dies with episodes in flight
        while gateway.restarts == 0:
            await asyncio.sleep(0.05)
        release.set()
        await task

    run_then_close(worker, scenario())
    assert sink.trajectories == []  # nothing of an episode the restart cut is trained
    m = worker.metrics()
    assert m["agent/gateway_restarts"] == 1 and m["agent/episodes_failed_gateway_restart"] == 2
    assert m["agent/episodes_failed/gateway_restart"] == 2 and m["rollout/groups_failed"] == 1


def test_a_slow_probe_is_not_a_dead_gateway_and_episodes_share_one_watchdog(engines, tokenizer):
    # a loaded machine delays probes: the gateway is restarted only after
    # health_check_failures of them in a row failed, and episodes starting meanwhile
    # neither bind a gateway of their own nor start another watchdog
    worker, _ = agent_worker(engines(1), tokenizer, ["s"], "two_calls", health_s=0.05)
    agents = worker.agents.agents
    probes: list[bool] = []

    async def slow_then_fine(timeout_s: float) -> bool:
        probes.append(len(probes) >= 2)  # the first two probes time out
        return probes[-1]

    async def scenario():
        agents.gateway.healthy = slow_then_fine
        urls = await asyncio.gather(*(agents.start() for _ in range(8)))
        watchdog = agents._watchdog
        while len(probes) < 5:
            await asyncio.sleep(0.05)
        assert set(urls) == {agents.gateway.base_url} and agents._watchdog is watchdog
        assert agents.gateway.restarts == 0  # 2 failed probes < health_check_failures (3)
        agents.gateway.healthy = lambda timeout_s: asyncio.sleep(0, result=False)
        while agents.gateway.restarts == 0:  # 3 in a row: restarted
            await asyncio.sleep(0.05)
        assert await agents.start() == urls[0]  # same address after the restart

    run_then_close(worker, scenario())


def test_a_weight_update_inside_a_call_tags_both_versions(engines, tokenizer):
    (engine,) = engines(1)
    worker, sink = agent_worker([engine], tokenizer, ["u 0", "u 1"], "one_long_call", n=2)

    async def scenario():
        midway = MidwayAction(engine, abort_and_update)
        task = asyncio.create_task(worker.run(num_groups=2))
        await asyncio.to_thread(midway.wait)
        await task

    run_then_close(worker, scenario())
    assert len(sink.trajectories) == 4
    versions = [t.token_versions.numpy().tolist() for t in sink.trajectories]
    assert all(v == sorted(v) for v in versions)
    assert any(set(v) == {0, 1} for v in versions)  # a call that straddled the update
    assert worker.metrics()["rollout/abort_resubmits"] >= 1


def test_a_template_without_a_tool_format_is_refused_at_start(tokenizer):
    from rollout_fleet.router import Router
    from rollout_fleet.sample_runner import SampleRunner

    config = AgentConfig(entrypoint=f"{MODULE}:two_calls")
    with pytest.raises(UnknownToolFormat, match="rollout.agent.tool_format"):
        AgentRollout(config, SampleRunner(Router(), {}), tokenizer, max_prompt_tokens=64)
