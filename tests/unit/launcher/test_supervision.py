"""Supervision pieces that need no Ray: non-finite streaks, run secrets, checkpoint fallback order,
buffer-restart retries."""

from __future__ import annotations

import json

import pytest
import zmq

from launcher.supervision import (
    BadStepGuard,
    BufferDown,
    Supervised,
    TrainingStopped,
    checkpoint_candidates,
    make_run_secrets,
)


def test_bad_step_guard_stops_after_k_consecutive_non_finite_steps_only():
    guard = BadStepGuard(3)
    for step, skipped in enumerate([1, 1, 0, 1, 1], start=1):  # a good step resets the streak
        guard.observe(step, bool(skipped))
    assert (guard.in_a_row, guard.total) == (2, 4)
    with pytest.raises(TrainingStopped, match=r"3 consecutive steps .*trainer\.max_bad_steps=3"):
        guard.observe(6, True)


def test_bad_step_guard_refuses_a_limit_below_one():
    with pytest.raises(ValueError, match="max_bad_steps must be >= 1"):
        BadStepGuard(0)


def test_secrets_are_made_off_loopback_an_engine_key_for_engines_needing_one_fresh_per_run():
    assert not make_run_secrets(False).secure
    assert make_run_secrets(False).engine_api_key is None
    # engines that refuse to start without a key (vLLM's) get one on loopback too
    keyed = make_run_secrets(False, engine_key=True)
    assert not keyed.secure and len(keyed.engine_api_key) >= 32
    first, second = make_run_secrets(True), make_run_secrets(True)
    assert first.secure and len(first.engine_api_key) >= 32
    assert first.engine_api_key != second.engine_api_key
    assert first.buffer_server.public != second.buffer_server.public
    # the buffer admits exactly the learner's and the fleet's client keys
    allowed = set(first.buffer_server.allowed_clients)
    assert allowed == {first.learner_client.public, first.rollout_client.public}
    assert first.learner_client.server_public == first.buffer_server.public
    assert zmq.has("curve")


def _fake_checkpoint(root, step, complete=True):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    (d / "__0_0.distcp").write_text("x")
    (d / "rng_rank0.pt").write_text("x")
    (d / "meta.json").write_text(json.dumps({"step": step, "world_size": 1}))
    if complete:
        (d / "COMPLETE").write_text("ok\n")
    return d


def test_checkpoint_candidates_are_complete_ones_newest_first(tmp_path):
    for step in (2, 4, 10):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 12, complete=False)  # interrupted save
    (tmp_path / "step_14.tmp").mkdir()
    names = [p.name for p in checkpoint_candidates(tmp_path)]
    assert names == ["step_10", "step_4", "step_2"]
    assert checkpoint_candidates(tmp_path / "missing") == []


def _buffer_down(err: BaseException, what: str) -> None:
    raise BufferDown(f"buffer (pid 1) died during {what}") from err


def test_buffer_down_restarts_and_retries_until_the_limit():
    calls, restarts = [], []

    class Roles:
        def wait_for_batch(self, version):
            calls.append(version)
            if len(calls) < 3:
                raise TimeoutError("no answer")
            return 0.5

    roles = Supervised(
        Roles(), diagnose=_buffer_down, restart_buffer=restarts.append, max_buffer_restarts=5
    )
    assert roles.wait_for_batch(7) == 0.5
    assert calls == [7, 7, 7] and restarts == [1, 2]
    assert roles.supervision_metrics() == {"supervision/buffer_restarts": 2.0}

    class AlwaysDown:
        def step(self, version):
            raise TimeoutError("no answer")

    roles = Supervised(
        AlwaysDown(), diagnose=_buffer_down, restart_buffer=lambda n: None, max_buffer_restarts=1
    )
    with pytest.raises(TrainingStopped, match="restarted 1 times already"):
        roles.step(1)
    assert roles.failed
