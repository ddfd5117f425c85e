"""Multi-turn rollouts on a real embedded engine over HTTP (tiny model, loopback).

Environments here are scripted ("module:function" names of this module): they
reply to the first turns and record what they saw. Turns end quickly because
the worker's stop tokens are ``<|im_end|>``, every letter and the other special
tokens (a random model rarely writes ``<|im_end|>``), so a special token only
ever ends a turn. Proves: the loss mask is 0 exactly on the environment's
tokens, which equal the chat template's delta; their logprobs are 0.0 and
their versions the token's before; the budget and max_turns end a sample as
"length"; an abort-mode pause mid-turn resumes the turn exactly; a raising or
hanging environment fails its own group with an error naming the environment
and the sample while other groups are sent; validation runs the same driver.
"""

from __future__ import annotations

import string
import threading
import time

import numpy as np
import pytest

from fleetrl.data.reader import PromptItem
from rollout_fleet.multi_turn.config import MultiTurnConfig
from tests.integration.rollout_fleet.test_worker_embedded import (
    abort_and_update,
    run_then_close,
    run_with_midway_action,
)
from tests.integration.rollout_fleet.test_worker_embedded import make_worker as make_embedded_worker

REPLIES = 2  # the scripted environment answers the first two turns, then says done
_calls: dict[str, list[list[dict]]] = {}  # prompt text -> the messages of every call
_lock = threading.Lock()


def _record(messages):
    with _lock:
        _calls.setdefault(messages[0]["content"], []).append([dict(m) for m in messages])


def replies_twice(messages, extra_info):
    _record(messages)
    turn = sum(m["role"] == "assistant" for m in messages)
    if turn > REPLIES:
        return None
    return {"role": "tool", "content": f"obs{turn}:{extra_info['tag']}"}


def always_replies(messages, extra_info):
    _record(messages)
    return {"role": "tool", "content": "more"}


def fails_on_some(messages, extra_info):
    content = messages[0]["content"]
    if "boom" in content:
        raise RuntimeError("tool crashed")
    if "slow" in content:
        time.sleep(1.5)
    return None


@pytest.fixture(autouse=True)
def fresh_calls():
    _calls.clear()


def stop_ids(tokenizer):
    specials = ["<|im_end|>", "<|im_start|>", "<pad>", "<bos>", "<eos>", "<unk>"]
    letters = tokenizer.encode(string.ascii_letters, add_special_tokens=False)
    return [tokenizer.convert_tokens_to_ids(t) for t in specials] + letters


def prompts(tokenizer, texts):
    items = []
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = np.asarray(tokenizer.encode(rendered, add_special_tokens=False), dtype=np.int32)
        items.append(PromptItem(i, ids, "synth/parity", "0", {"tag": f"t{i}"}, messages))
    return items


def make_worker(engine, tokenizer, items, *, env, max_new_tokens, n=1, **multi_turn):
    worker, _, sink = make_embedded_worker(
        [engine],
        tokenizer,
        n=n,
        items=items,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids(tokenizer),
        multi_turn=MultiTurnConfig(env=f"{__name__}:{env}", **multi_turn),
    )
    return worker, sink


def runs(mask):
    """[(value, start, end)] of the maximal runs of equal values in ``mask``."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def check_env_segments(traj, tokenizer, conversation):
    """Mask 0 exactly on the environment's tokens, which are the template's delta after each
    turn; environment tokens have logprob 0.0 and the previous token's version."""
    traj.validate()
    response = traj.response_ids.numpy().tolist()
    mask = traj.loss_mask.numpy().tolist()
    logprobs = traj.behavior_logprobs.numpy()
    versions = traj.token_versions.numpy().tolist()
    segments = runs(mask)
    assert segments[0][0] == 1  # a response starts with a generated turn
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = list(conversation[:1])
    observations = [m for m in conversation if m["role"] == "tool"]
    for value, start, end in segments:
        tokens = response[start:end]
        if value == 1:  # the policy's turn: what the environment saw as the assistant message
            assert np.all(logprobs[start:end] < 0)
            assistant = {
                "role": "assistant",
                "content": tokenizer.decode(tokens, skip_special_tokens=True),
            }
            if len(messages) < len(conversation):  # else: a last turn the environment never saw
                assert conversation[len(messages)] == assistant
            messages.append(assistant)
            continue
        observation = observations.pop(0)
        before = tokenizer.encode(
            tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False
        )
        after = tokenizer.encode(
            tokenizer.apply_chat_template(
                [*messages, observation], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        assert after[: len(before)] == before
        closing = "\n" if response[start - 1] == im_end else "<|im_end|>\n"
        expected = tokenizer.encode(closing, add_special_tokens=False) + after[len(before) :]
        assert tokens == expected[: len(tokens)]  # cut only at the end of the budget
        assert len(tokens) == len(expected) or end == len(response)
        assert np.all(logprobs[start:end] == 0.0)
        assert versions[start:end] == [versions[start - 1]] * (end - start)
        messages.append(observation)


def test_env_tokens_are_the_template_delta_with_mask_0_logprob_0_previous_version(
    engine, tokenizer
):
    items = prompts(tokenizer, [f"q{i}" for i in range(4)])
    worker, sink = make_worker(
        engine, tokenizer, items, env="replies_twice", max_new_tokens=300, max_turns=5
    )
    run_then_close(worker, worker.run(num_groups=4))
    assert len(sink.trajectories) == 4
    for traj in sink.trajectories:
        conversation = _calls[f"q{traj.prompt_index}"][-1]
        assert len(_calls[f"q{traj.prompt_index}"]) == REPLIES + 1
        assert traj.finish_reason == "stop"  # the environment said done after the third turn
        check_env_segments(traj, tokenizer, conversation)
        assert sum(v == 0 for v, _, _ in runs(traj.loss_mask.numpy().tolist())) == REPLIES
        assert "env_s" in traj.timings
    metrics = worker.metrics()
    assert metrics["rollout/multi_turn/turns_per_sample"] == REPLIES + 1
    expected_env = sum(int((t.loss_mask.numpy() == 0).sum()) for t in sink.trajectories) / 4
    assert metrics["rollout/multi_turn/env_tokens_per_sample"] == expected_env
    assert metrics["rollout/multi_turn/env_steps"] == 4 * (REPLIES + 1)


def test_the_budget_of_the_whole_response_ends_a_sample_as_length(engine, tokenizer):
    items = prompts(tokenizer, [f"b{i}" for i in range(3)])
    worker, sink = make_worker(
        engine, tokenizer, items, env="always_replies", max_new_tokens=40, max_turns=100
    )
    run_then_close(worker, worker.run(num_groups=3))
    assert len(sink.trajectories) == 3
    for traj in sink.trajectories:
        assert traj.finish_reason == "length"
        assert len(traj.response_ids) == 40  # generated + environment tokens fill the budget
        conversation = [*_calls[f"b{traj.prompt_index}"][-1], {"role": "tool", "content": "more"}]
        check_env_segments(traj, tokenizer, conversation)


def test_max_turns_ends_a_sample_as_length_without_a_reply_after_the_last_turn(engine, tokenizer):
    items = prompts(tokenizer, [f"m{i}" for i in range(3)])
    worker, sink = make_worker(
        engine, tokenizer, items, env="always_replies", max_new_tokens=400, max_turns=2
    )
    run_then_close(worker, worker.run(num_groups=3))
    assert len(sink.trajectories) == 3
    for traj in sink.trajectories:
        assert traj.finish_reason == "length" and len(traj.response_ids) < 400
        assert [v for v, _, _ in runs(traj.loss_mask.numpy().tolist())] == [1, 0, 1]
        calls = _calls[f"m{traj.prompt_index}"]
        assert len(calls) == 2  # asked after both turns; the second reply is not appended
        check_env_segments(traj, tokenizer, calls[-1])  # user, turn, reply, turn


def test_abort_mode_pause_mid_turn_resumes_the_turn_exactly(engine, tokenizer):
    items = prompts(tokenizer, [f"a{i}" for i in range(6)])
    worker, sink = make_worker(
        engine, tokenizer, items, env="replies_twice", max_new_tokens=300, max_turns=5, n=2
    )
    run_with_midway_action(worker, engine, 6, abort_and_update)
    assert len(sink.trajectories) == 12
    assert worker.metrics()["rollout/abort_resubmits"] >= 1
    straddling = 0
    for traj in sink.trajectories:
        versions = traj.token_versions.numpy().tolist()
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        straddling += set(versions) == {0, 1}
        assert traj.finish_reason == "stop"
        assert sum(v == 0 for v, _, _ in runs(traj.loss_mask.numpy().tolist())) == REPLIES
        # every sample of a group saw its own conversation: find the one this response renders
        candidates = [c for c in _calls[f"a{traj.prompt_index}"] if len(c) == 2 * REPLIES + 2]
        matched = 0
        for conversation in candidates:
            try:
                check_env_segments(traj, tokenizer, conversation)
                matched += 1
            except AssertionError:
                continue
        assert matched >= 1
    assert straddling >= 1  # a turn (or a response) continued on version 1


def test_a_raising_or_hanging_env_fails_its_own_group_naming_env_and_sample(
    engine, tokenizer, caplog
):
    items = prompts(tokenizer, ["ok0", "boom", "slow", "ok1"])
    worker, sink = make_worker(
        engine,
        tokenizer,
        items,
        env="fails_on_some",
        max_new_tokens=60,
        env_timeout_s=0.5,
        n=2,
    )
    run_then_close(worker, worker.run(num_groups=4))
    sent = {t.prompt_index for t in sink.trajectories}
    assert sent == {0, 3} and len(sink.trajectories) == 4  # the other groups lose nothing
    assert worker.groups_failed == 2
    metrics = worker.metrics()
    assert metrics["rollout/multi_turn/env_errors"] >= 1
    assert metrics["rollout/multi_turn/env_timeouts"] >= 1
    env = f"{__name__}:fails_on_some"
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2
    assert any(f"environment '{env}' raised RuntimeError('tool crashed')" in m for m in dropped)
    assert any(f"environment '{env}' timed out after 0.5 s" in m for m in dropped)
    assert all(": sample " in m for m in dropped)  # ... and the sample it failed


def test_validation_runs_the_same_driver(engine, tokenizer):
    items = prompts(tokenizer, [f"v{i}" for i in range(3)])
    worker, sink = make_worker(
        engine, tokenizer, [], env="replies_twice", max_new_tokens=300, max_turns=5
    )
    # sampled, not greedy: a greedy random model may never write a stop token
    validation = run_then_close(worker, worker.validate(items, temperature=1.0, keep_samples=3))
    result = validation.metrics
    assert result["val/num_samples"] == 3 and result["val/num_failed"] == 0
    assert result["val-aux/num_turns/mean"] == result["val-aux/num_turns/max"] == REPLIES + 1
    assert [s.turns for s in validation.samples] == [REPLIES + 1] * 3
    assert all(len(_calls[f"v{i}"]) == REPLIES + 1 for i in range(3))
    assert sink.trajectories == []
