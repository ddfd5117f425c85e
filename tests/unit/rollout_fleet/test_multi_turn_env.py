"""Environments: how config names one, what a reply must be, and how a failing one fails its sample."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from rollout_fleet.config import RolloutConfig
from rollout_fleet.multi_turn.calculator import calculator_env
from rollout_fleet.multi_turn.env_runner import EnvironmentFailed, EnvRunner
from rollout_fleet.multi_turn.environment import EnvLoadError, check_observation, load_env
from rollout_fleet.sample_runner import SampleFailed

MESSAGES = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def echo_env(messages, extra_info):
    return {"role": "user", "content": f"{len(messages)}:{extra_info['tag']}"}


def mutating_env(messages, extra_info):
    messages.append({"role": "user", "content": "injected"})
    messages[0]["content"] = "changed"
    return None


def positional_only_env(conversation):
    return None


NOT_CALLABLE = 3


def test_builtin_and_module_function_names_load():
    assert load_env("calculator") is calculator_env
    assert load_env(f"{__name__}:echo_env") is echo_env


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("calculatr", "neither a built-in environment (calculator) nor 'module:function'"),
        ("module:", "neither a built-in"),
        (":fn", "neither a built-in"),
        ("a:b:c", "neither a built-in"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:missing", "has no callable 'missing'"),
        (f"{__name__}:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
        (f"{__name__}:positional_only_env", "cannot be called with keywords messages, extra_info"),
    ],
)
def test_unusable_env_names_are_refused_naming_the_config_key(spec, error):
    with pytest.raises(EnvLoadError, match=r"^rollout\.multi_turn\.env: ") as raised:
        load_env(spec)
    assert error in str(raised.value)


def test_config_refuses_a_bad_env_name_at_load_naming_the_field():
    with pytest.raises(msgspec.ValidationError, match="env 'calculatr' is neither") as raised:
        msgspec.convert({"multi_turn": {"env": "calculatr"}}, RolloutConfig)
    assert "multi_turn" in str(raised.value)
    with pytest.raises(msgspec.ValidationError, match="max_turns"):
        msgspec.convert({"multi_turn": {"env": "calculator", "max_turns": 0}}, RolloutConfig)
    on = msgspec.convert({"multi_turn": {"env": "calculator"}}, RolloutConfig).multi_turn
    assert on.enabled and not RolloutConfig().multi_turn.enabled  # off by default


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("42", "returned a str, not a message dict or None"),
        ({"content": "x"}, "needs string 'role' and 'content'"),
        ({"role": "tool", "content": 42}, "needs string 'role' and 'content'"),
        ({"role": "", "content": "x"}, "needs string 'role' and 'content'"),
        ({"role": "assistant", "content": "x"}, "only the policy speaks as assistant"),
    ],
)
def test_a_reply_that_is_not_a_message_is_refused(value, error):
    with pytest.raises(ValueError, match=error):
        check_observation(value, "calc", "g/0")


def test_a_message_reply_and_none_pass():
    reply = {"role": "tool", "content": "4", "name": "calc"}
    assert check_observation(reply, "calc", "g/0") == reply
    assert check_observation(None, "calc", "g/0") is None


def test_runner_returns_the_reply_and_the_env_sees_a_copy_of_the_conversation():
    runner = EnvRunner("echo", echo_env, timeout_s=5, max_workers=2)
    reply, seconds = asyncio.run(runner.step("g/0", MESSAGES, {"tag": "x"}))
    assert reply == {"role": "user", "content": "2:x"} and seconds >= 0
    messages = [dict(m) for m in MESSAGES]
    mutator = EnvRunner("mutating", mutating_env, timeout_s=5, max_workers=1)
    assert asyncio.run(mutator.step("g/0", messages, None))[0] is None
    assert messages == MESSAGES
    assert runner.num_steps == 1 and runner.num_errors == 0


def test_raising_env_fails_the_sample_naming_env_and_sample():
    def boom(messages, extra_info):
        raise RuntimeError("tool crashed")

    runner = EnvRunner("boom", boom, timeout_s=5, max_workers=1)
    with pytest.raises(EnvironmentFailed) as raised:
        asyncio.run(runner.step("group-7/1", MESSAGES, None))
    assert isinstance(raised.value, SampleFailed)  # the path of a sample whose engines failed
    assert (
        str(raised.value)
        == "sample group-7/1: environment 'boom' raised RuntimeError('tool crashed')"
    )
    assert runner.num_errors == 1


def test_bad_reply_fails_the_sample_naming_env_and_sample():
    runner = EnvRunner("bad", lambda messages, extra_info: 7, timeout_s=5, max_workers=1)
    with pytest.raises(EnvironmentFailed, match=r"sample g/3: environment 'bad' returned a int"):
        asyncio.run(runner.step("g/3", MESSAGES, None))


def test_hung_env_times_out_without_blocking_the_loop_or_later_steps():
    def slow(messages, extra_info):
        time.sleep(extra_info["sleep_s"])
        return None

    runner = EnvRunner("slow", slow, timeout_s=0.2, max_workers=1)

    async def scenario():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        with pytest.raises(EnvironmentFailed, match="'slow' timed out after 0.2 s"):
            await runner.step("g/0", MESSAGES, {"sleep_s": 3.0})
        elapsed = time.monotonic() - start
        # the only slot was freed at the timeout: a quick step runs at once
        reply, _ = await runner.step("g/1", MESSAGES, {"sleep_s": 0.0})
        ticker.cancel()
        return elapsed, ticks, reply

    elapsed, ticks, reply = asyncio.run(scenario())
    assert elapsed < 2.0 and ticks >= 5 and reply is None
    assert runner.num_timeouts == 1 and runner.num_hung == 1
