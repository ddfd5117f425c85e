"""The reward-model schedule (``train_rm_loop``) on a fake group: what it calls, when."""

from __future__ import annotations

import pytest

from launcher.rm_config import load_rm_config
from launcher.rm_roles import RmStepResult
from launcher.rm_train import train_rm_loop
from launcher.step_calls import StopRequested
from launcher.supervision import TrainingStopped
from learner.bradley_terry import summarize_pairs


class FakeGroup:
    def __init__(self, skipped: set[int] = frozenset()):
        self.calls: list[str] = []
        self.steps = 0
        self.skipped = skipped

    def step(self) -> RmStepResult:
        self.steps += 1
        self.calls.append(f"step{self.steps}")
        return RmStepResult(skipped_nonfinite=self.steps in self.skipped, metrics={"train/loss": 0.5})  # fmt: skip

    def evaluate(self):
        self.calls.append("evaluate")
        return summarize_pairs([1.0, 2.0], [0.0, 3.0])

    def checkpoint(self) -> str:
        self.calls.append("checkpoint")
        return "ckpt"

    def export(self, stats) -> str:
        self.calls.append(f"export(mean={stats.mean:.2f})")
        return "rm"


class Tracker:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, step: int, metrics: dict) -> None:
        self.logged.append((step, metrics))


class NoStop:
    def check(self) -> None:
        pass


def _cfg(*overrides: str):
    return load_rm_config(None, ["data.train_files=[p.parquet]", *overrides])


def test_held_out_every_test_freq_and_checkpoint_and_folder_every_save_freq_and_at_the_end():
    group, tracker = FakeGroup(), Tracker()
    cfg = _cfg("trainer.total_steps=5", "trainer.test_freq=2", "trainer.save_freq=4")
    final = train_rm_loop(group, cfg, 0, tracker, NoStop())
    assert group.calls == [
        "step1", "step2", "evaluate", "step3",
        "step4", "evaluate", "checkpoint", "export(mean=1.50)",  # the evaluation is reused
        "step5", "evaluate", "checkpoint", "export(mean=1.50)",  # the end, even off-cycle
    ]  # fmt: skip
    assert [step for step, _ in tracker.logged] == [1, 2, 3, 4, 5]
    assert "val/accuracy" in tracker.logged[1][1] and "val/accuracy" not in tracker.logged[2][1]
    assert final.accuracy == 0.5


def test_a_resumed_loop_starts_after_its_step_and_a_stop_request_ends_it_between_steps():
    group, tracker = FakeGroup(), Tracker()
    train_rm_loop(group, _cfg("trainer.total_steps=3"), 2, tracker, NoStop())
    assert [step for step, _ in tracker.logged] == [3]
    assert group.calls == ["step1", "checkpoint", "evaluate", "export(mean=1.50)"]

    class StopAfterOne:
        checks = 0

        def check(self):
            self.checks += 1
            if self.checks > 1:
                raise StopRequested("SIGTERM")

    group = FakeGroup()
    with pytest.raises(StopRequested):
        train_rm_loop(group, _cfg("trainer.total_steps=5"), 0, Tracker(), StopAfterOne())
    assert group.calls == ["step1"]


def test_consecutive_non_finite_steps_stop_the_run_at_max_bad_steps():
    group = FakeGroup(skipped={2, 3})
    cfg = _cfg("trainer.total_steps=6", "trainer.max_bad_steps=2")
    with pytest.raises(TrainingStopped, match="2 consecutive steps"):
        train_rm_loop(group, cfg, 0, Tracker(), NoStop())
    assert group.steps == 3
