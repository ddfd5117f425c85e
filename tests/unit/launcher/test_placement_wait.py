"""The placement wait is bounded and explained; a signal during start-up interrupts at once.

No Ray here: the "is it placed yet" probe and the description of what is missing are
fakes, and the clock is the real one with a short ``ray.placement_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import signal

import pytest

import launcher.placement as placement
from launcher.config import load_run_config
from launcher.placement import PlacementTimeout, _wait
from launcher.supervision import TrainingStopped
from launcher.train import StartupInterrupted, StopSignal


@pytest.fixture
def fast_progress(monkeypatch):
    monkeypatch.setattr(placement, "PLACEMENT_PROGRESS_S", 0.2)
    monkeypatch.setattr(placement, "PLACEMENT_POLL_S", 0.05)
    monkeypatch.setattr(
        placement, "missing", lambda cfg, parts: f"no '{'/'.join(parts)}' node with GPU 8"
    )


def test_wait_stops_after_the_timeout_naming_what_is_missing(fast_progress, caplog):
    cfg = load_run_config(None, ["ray.placement_timeout_s=0.6"])
    removed = []
    fleetrl_log = logging.getLogger("fleetrl")  # setup_logging may stop it propagating
    fleetrl_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, "fleetrl"), pytest.raises(PlacementTimeout) as err:
            _wait(
                cfg, "the learner group", ("learner",), lambda t: False, lambda: removed.append(1)
            )
    finally:
        fleetrl_log.removeHandler(caplog.handler)
    assert isinstance(err.value, TrainingStopped)  # train.main: exit 1, one line
    assert str(err.value) == (
        "the learner group was not placed within 1s (ray.placement_timeout_s): "
        "no 'learner' node with GPU 8"
    )
    assert removed == [1]  # the pending placement group is removed
    progress = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert progress and all("to place the learner group: no 'learner'" in m for m in progress)


def test_wait_returns_once_placed(fast_progress):
    cfg = load_run_config(None, ["ray.placement_timeout_s=30"])
    polls = iter([False, False, True])
    _wait(cfg, "the rollout fleet", ("rollout", "reward"), lambda t: next(polls))


def test_signal_during_start_up_interrupts_at_once_and_names_itself():
    stop = StopSignal()
    stop.install()
    try:
        with pytest.raises(KeyboardInterrupt):  # the one exception Ray's waits let through
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM"
        stop.received, stop.starting = None, False
        os.kill(os.getpid(), signal.SIGTERM)  # once training: only a flag, checked per step
        assert stop.received == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_startup_interrupted_exit_code_and_line():
    err = StartupInterrupted("SIGTERM", "placing the learner group")
    assert err.exit_code == 143
    assert str(err) == (
        "stopped by SIGTERM while placing the learner group; "
        "every role started so far has been ended"
    )
    assert StartupInterrupted("SIGINT", "x").exit_code == 130
