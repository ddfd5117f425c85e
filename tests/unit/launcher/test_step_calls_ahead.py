"""A step's publish asks the rollout role, behind its acknowledgement, which engines wait
for weights; the rejoin check that follows reads that answer instead of asking again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import ray

from launcher.config import load_run_config
from launcher.results import PublishResult
from launcher.session import Run
from rollout_fleet.membership import WeightTargets

NOBODY_WAITS = object()  # the reference rejoin_targets returns; its value: no engine waits


class _Call:
    def __init__(self, name, calls, answer=None):
        self.remote = lambda *args: calls.append(name) or (answer(*args) if answer else None)


def _run(tmp_path: Path, monkeypatch) -> tuple[Run, list[str]]:
    run = Run(load_run_config(None, [f"trainer.output_dir={tmp_path}"]), address=None)
    calls: list[str] = []
    run.learners = [
        SimpleNamespace(publish=_Call("publish", calls, lambda v, t, r: PublishResult(version=v)))
    ]
    run.rollout = SimpleNamespace(
        weight_targets=_Call("weight_targets", calls, lambda: WeightTargets()),
        weights_published=_Call("weights_published", calls),
        rejoin_targets=_Call("rejoin_targets", calls, lambda: NOBODY_WAITS),
        metrics=_Call("metrics", calls),
    )
    run.buffer = SimpleNamespace(stats=_Call("stats", calls))
    monkeypatch.setattr(ray, "get", lambda x, **kw: None if x is NOBODY_WAITS else x)
    monkeypatch.setattr("launcher.step_calls.gather", lambda refs, what: list(refs))
    return run, calls


def test_a_steps_publish_asks_the_rejoin_check_behind_its_acknowledgement(tmp_path, monkeypatch):
    run, calls = _run(tmp_path, monkeypatch)
    run.steps_taken = 3
    run.publish(4)
    assert calls == ["weight_targets", "publish", "weights_published", "rejoin_targets"]
    calls.clear()
    run.rejoin_engines()
    assert "rejoin_targets" not in calls  # the answer asked ahead is read
    run.rejoin_engines()
    assert calls.count("rejoin_targets") == 1  # nothing ahead any more: asked afresh


def test_the_first_and_a_restored_publish_ask_nothing_ahead(tmp_path, monkeypatch):
    run, calls = _run(tmp_path, monkeypatch)
    run.publish(0)  # the first weights, before any step
    run.steps_taken = 5
    run.publish(5, restored=True)  # a resumed run's first push
    assert "rejoin_targets" not in calls
