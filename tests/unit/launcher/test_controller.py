"""The training controller on fake role handles, without Ray: the schedule, restart, retry, stop.

``launcher.train.execute`` drives a session whose role calls are guarded by
``launcher.supervision.Supervised``; here the session is a fake that records every
call and can play a dead buffer, a dead learner rank or a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config import load_run_config
from launcher.results import CheckpointRecord, PublishResult, StartRecord, StepResult
from launcher.step_calls import RewardsFailing, StopRequested
from launcher.supervision import BufferDown, Supervised, TrainingStopped
from launcher.tracking import Tracker, read_metrics
from launcher.train import execute
from rollout_fleet.validation import Validation


class RoleFault(Exception):
    """What a Ray call raises when an actor is gone (RayError in a real run)."""


class FakeStop:
    def __init__(self, after_step: int | None = None) -> None:
        self.after_step = after_step
        self.session: FakeSession | None = None
        self.received: str | None = None
        self.starting = True

    def install(self) -> None: ...

    def restore(self) -> None: ...

    def check(self) -> None:
        steps = self.session.steps if self.session else 0
        if self.after_step is not None and steps >= self.after_step:
            raise StopRequested("SIGTERM")


class FakeSession:
    """Role calls as ``launcher.session.Run`` offers them, recorded; faults on request."""

    def __init__(self, origin: StartRecord | None = None) -> None:
        self.origin = origin or StartRecord()
        self.calls: list[tuple] = []
        self.steps = self.origin.step
        self.dead: str | None = None  # the role a diagnosis finds dead
        self.fail_at: dict[tuple[str, int], str] = {}  # (call, step) -> role that dies then
        self.skipped_nonfinite = False
        self.restarts: list[int] = []
        self.closed_failed: bool | None = None
        self.started = False
        self.phase = "starting"
        self.rewards_fail_at: int | None = None  # from this step on the reward fails always
        self.fetch_next: list[bool] = []  # per step: was the next batch's fetch queued with it

    # lifecycle
    def start(self, after_ray_init=None) -> StartRecord:
        if after_ray_init is not None:
            after_ray_init()
        self.started = True
        return self.origin

    def supervised(self) -> Supervised:
        return Supervised(
            self, diagnose=self.diagnose, restart_buffer=self.restart_buffer, faults=(RoleFault,)
        )

    def diagnose(self, err: BaseException, what: str) -> None:
        if self.dead == "buffer":
            raise BufferDown(f"buffer (pid 1) died during {what}") from err
        if self.dead is not None:
            raise TrainingStopped(f"{self.dead} (pid 2) died during {what}") from err
        raise err

    def restart_buffer(self, count: int) -> None:
        self.restarts.append(count)
        self.dead = None

    def close(self, failed: bool = False) -> None:
        self.closed_failed = failed

    # role calls
    def _maybe_fail(self, call: str) -> None:
        role = self.fail_at.pop((call, self.steps), None)
        if role is not None:
            self.dead = role if role != "bug" else None
            raise RoleFault(f"{call} failed")

    def wait_for_batch(self, version: int, check_stop) -> float:
        self.calls.append(("wait_for_batch", version))
        check_stop()
        self._maybe_fail("wait_for_batch")
        if self.rewards_fail_at is not None and self.steps >= self.rewards_fail_at:
            raise RewardsFailing("the reward failed on every sample of 200 groups in a row")
        return 0.25

    def resume_hint(self) -> str:
        return f"rerun to continue from step_{self.steps}"

    def step(
        self,
        version: int,
        publish: bool = False,
        snapshot_step: int | None = None,
        fetch_next: bool = False,
    ) -> StepResult:
        self.calls.append(("step", version))
        self.fetch_next.append(fetch_next)
        if snapshot_step is not None:
            self.calls.append(("snapshot_queued", snapshot_step))
        self._maybe_fail("step")
        self.steps += 1
        metrics = {"perf/total_num_tokens": 100.0, "actor/pg_loss": 0.1}
        if self.skipped_nonfinite:
            metrics["actor/skipped_nonfinite"] = 1.0
        return StepResult.from_metrics(version, metrics)

    def publish(self, version: int) -> PublishResult:
        self.calls.append(("publish", version))
        self._maybe_fail("publish")
        return PublishResult(version=version, metrics={"weight_sync/num_failed": 0.0})

    def rejoin_engines(self) -> None:
        self.calls.append(("rejoin_engines",))

    def validate(self) -> Validation:
        self.calls.append(("validate", self.steps))
        return Validation(metrics={"val/score/mean": 0.5 + 0.1 * self.steps})

    def start_profile(self, step: int) -> None:
        self.calls.append(("start_profile", step))

    def stop_profile(self, step: int) -> list[str]:
        self.calls.append(("stop_profile", step))
        return [f"profile/step_{step}/learner_rank0.json"]

    def save_hf_snapshot(self, step: int) -> str:
        self.calls.append(("save_hf_snapshot", step))
        return f"hf_snapshots/step_{step}"

    def checkpoint(self, step: int) -> CheckpointRecord:
        self.calls.append(("checkpoint", step))
        return CheckpointRecord(path=f"step_{step}", step=step, policy_version=step, watermark=0)

    def role_metrics(self) -> dict[str, float]:
        return {"buffer/size": 3.0}


def _cfg(tmp_path: Path, *overrides: str):
    return load_run_config(
        None,
        [
            f"trainer.output_dir={tmp_path}",
            "trainer.total_steps=4",
            "trainer.test_freq=2",
            "trainer.save_freq=2",
            "data.train_batch_size=2",
            f"data.val_files={tmp_path / 'val.parquet'}",
            "rollout.n=3",
            *overrides,
        ],
    )


def _execute(tmp_path: Path, session: FakeSession, stop: FakeStop | None = None, *overrides):
    cfg = _cfg(tmp_path, *overrides)
    stop = stop or FakeStop()
    stop.session = session
    tracker = Tracker(cfg.logging, tmp_path, cfg.trainer.total_steps, {})
    try:
        return execute(session, cfg, tracker, stop), read_metrics(tracker.metrics_path)
    finally:
        tracker.close()


def _names(session: FakeSession) -> list[str]:
    return [c[0] for c in session.calls]


def test_one_step_is_wait_step_publish_rejoin_then_validate_and_checkpoint_when_due(tmp_path):
    session = FakeSession()
    summary, rows = _execute(tmp_path, session)
    per_step = ["wait_for_batch", "step", "publish", "rejoin_engines"]
    due = ["validate", "checkpoint"]
    assert _names(session) == ["validate"] + per_step + per_step + due + per_step + per_step + due
    assert [c[1] for c in session.calls if c[0] == "publish"] == [1, 2, 3, 4]
    assert [c[1] for c in session.calls if c[0] == "step"] == [0, 1, 2, 3]  # trained against v
    # each step but the last queues the next one's fetch (the last would hold one unused)
    assert session.fetch_next == [True, True, True, False]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [(r["step"], r["policy_version"]) for r in train] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert all(r["supervision/buffer_restarts"] == 0 and r["timing_s/gen"] == 0.25 for r in train)
    assert summary["samples"] == 4 * 2 * 3 and summary["initial_val_score"] == 0.5
    assert summary["final_val_score"] == pytest.approx(0.9)
    assert session.closed_failed is False


@pytest.mark.parametrize(
    ("overrides", "validated_at"),
    [
        (["trainer.val_before_train=false"], [2, 4]),  # test_freq alone: no validation first
        (["trainer.test_freq=-1"], [0]),  # verl's default: once before training, then never
        (["trainer.test_freq=-1", "trainer.val_before_train=false"], []),
        (["trainer.test_freq=-1", "data.val_files=[]"], []),  # nothing to validate on
    ],
)
def test_validation_before_training_is_val_before_train_not_test_freq(
    tmp_path, overrides, validated_at
):
    session = FakeSession()
    _execute(tmp_path, session, None, *overrides)
    assert [c[1] for c in session.calls if c[0] == "validate"] == validated_at


def test_a_profiled_step_is_recorded_from_its_wait_to_its_checkpoint(tmp_path):
    session = FakeSession()
    _execute(
        tmp_path, session, None, "trainer.profile_steps=[2,4]", "trainer.val_before_train=false"
    )
    names = _names(session)
    first = names[names.index("start_profile") : names.index("stop_profile") + 1]
    assert first == ["start_profile", "wait_for_batch", "step", "publish", "rejoin_engines",
                     "validate", "checkpoint", "stop_profile"]  # fmt: skip
    assert [c for c in session.calls if "profile" in c[0]] == [
        ("start_profile", 2), ("stop_profile", 2), ("start_profile", 4), ("stop_profile", 4),
    ]  # fmt: skip


@pytest.mark.parametrize(("save_freq", "saved_at"), [(2, [2, 4]), (3, [3, 4]), (-1, [4]), (0, [])])
def test_save_freq_minus_one_saves_the_last_step_only_and_zero_never(tmp_path, save_freq, saved_at):
    session = FakeSession()
    _execute(tmp_path, session, None, f"trainer.save_freq={save_freq}")
    assert [c[1] for c in session.calls if c[0] == "checkpoint"] == saved_at


def test_a_stop_with_save_freq_zero_writes_no_checkpoint(tmp_path):
    session = FakeSession()
    summary, _ = _execute(tmp_path, session, FakeStop(after_step=1), "trainer.save_freq=0")
    assert summary["interrupted"] == "SIGTERM"
    assert "checkpoint" not in _names(session)


def test_policy_snapshots_before_training_every_save_hf_freq_steps_and_at_the_end(tmp_path):
    session = FakeSession()
    _execute(
        tmp_path, session, None, "trainer.save_hf_freq=3", "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    )  # fmt: skip
    assert [c[1] for c in session.calls if c[0] == "save_hf_snapshot"] == [0, 3, 4]
    # each snapshot follows its step's publish: it holds the weights the engines serve
    names = _names(session)
    assert names[:1] == ["save_hf_snapshot"] and "validate" not in names
    third = [i for i, c in enumerate(session.calls) if c == ("publish", 3)][0]
    assert session.calls[third + 2] == ("save_hf_snapshot", 3)
    # asked for with the step it follows, so the learner writes it without waiting
    assert [c[1] for c in session.calls if c[0] == "snapshot_queued"] == [3, 4]
    assert session.calls[session.calls.index(("snapshot_queued", 3)) - 1] == ("step", 2)


def test_no_policy_snapshot_unless_asked_or_after_a_resume(tmp_path):
    session = FakeSession()
    _execute(tmp_path, session)
    assert "save_hf_snapshot" not in _names(session)
    origin = StartRecord(step=4, policy_version=4, resumed_from="step_4")
    session = FakeSession(origin)
    _execute(tmp_path, session, None, "trainer.total_steps=6", "trainer.save_hf_freq=1")
    assert [c[1] for c in session.calls if c[0] == "save_hf_snapshot"] == [5, 6]


def test_publish_every_sync_every_steps(tmp_path):
    session = FakeSession()
    _, rows = _execute(tmp_path, session, None, "weight_sync.sync_every=2")
    assert [c[1] for c in session.calls if c[0] == "publish"] == [1, 2]
    assert [c[1] for c in session.calls if c[0] == "step"] == [0, 0, 1, 1]
    assert [r["policy_version"] for r in rows if "actor/pg_loss" in r] == [0, 1, 1, 2]


@pytest.mark.parametrize("call", ["wait_for_batch", "step", "publish"])
def test_dead_buffer_is_restarted_and_the_call_retried_with_the_same_arguments(tmp_path, call):
    session = FakeSession()
    session.fail_at[(call, 2 if call != "publish" else 3)] = "buffer"
    summary, rows = _execute(tmp_path, session)
    assert session.restarts == [1]
    failed_and_retried = [c for c in session.calls if c[0] == call][2:4]
    assert failed_and_retried[0] == failed_and_retried[1]  # same version both times
    assert [c[1] for c in session.calls if c[0] == "publish"][-1] == 4  # no version skipped
    assert rows[-1]["supervision/buffer_restarts"] == 1.0 and rows[-1]["step"] == 4
    assert session.closed_failed is False and "interrupted" not in summary


def test_buffer_that_keeps_dying_stops_the_run_after_the_limit(tmp_path):
    session = FakeSession()
    session.fail_at = {("wait_for_batch", 1): "buffer"}
    roles = session.supervised()
    roles.max_buffer_restarts = 0
    session.supervised = lambda: roles
    with pytest.raises(TrainingStopped, match="restarted 0 times already"):
        _execute(tmp_path, session)
    assert session.closed_failed is True


def test_dead_learner_stops_cleanly_without_a_checkpoint(tmp_path):
    session = FakeSession()
    session.fail_at[("step", 2)] = "learner rank 0"
    with pytest.raises(TrainingStopped, match=r"learner rank 0 \(pid 2\) died during step"):
        _execute(tmp_path, session)
    assert session.restarts == []
    assert session.closed_failed is True  # every role is killed, not asked to stop
    assert [c for c in session.calls if c[0] == "checkpoint"] == [("checkpoint", 2)]


def test_a_fault_with_nothing_dead_is_a_bug_and_propagates_unretried(tmp_path):
    session = FakeSession()
    session.fail_at[("publish", 1)] = "bug"
    with pytest.raises(RoleFault, match="publish failed"):
        _execute(tmp_path, session)
    assert [c for c in session.calls if c[0] == "publish"] == [("publish", 1)]
    assert session.restarts == [] and session.closed_failed is False


def test_stop_request_finishes_the_step_and_checkpoints_once(tmp_path):
    session = FakeSession()
    summary, rows = _execute(tmp_path, session, FakeStop(after_step=3))
    assert summary["interrupted"] == "SIGTERM"
    assert [c for c in session.calls if c[0] == "checkpoint"] == [("checkpoint", 2), ("checkpoint", 3)]  # fmt: skip
    assert rows[-1]["step"] == 3 and session.closed_failed is False


def test_resume_continues_the_step_and_version_and_does_not_rewrite_its_checkpoint(tmp_path):
    origin = StartRecord(step=4, policy_version=4, resumed_from="step_4")
    session = FakeSession(origin)
    summary, rows = _execute(tmp_path, session, FakeStop(after_step=4), "trainer.total_steps=8")
    assert summary["resumed_from"] == "step_4" and summary["interrupted"] == "SIGTERM"
    assert "validate" not in _names(session) and "checkpoint" not in _names(session)
    session = FakeSession(origin)
    (tmp_path / "again").mkdir()
    _, rows = _execute(tmp_path / "again", session, None, "trainer.total_steps=6")
    assert [c[1] for c in session.calls if c[0] == "step"] == [4, 5]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [5, 6]


def test_non_finite_steps_in_a_row_stop_the_run(tmp_path):
    session = FakeSession()
    session.skipped_nonfinite = True
    with pytest.raises(TrainingStopped, match="3 consecutive steps had a non-finite loss"):
        _execute(tmp_path, session, None, "trainer.total_steps=10")
    assert session.steps == 3


def test_a_reward_failing_on_everything_checkpoints_then_stops_with_its_reason(tmp_path):
    session = FakeSession()
    session.rewards_fail_at = 1
    with pytest.raises(TrainingStopped) as err:
        _execute(tmp_path, session, None, "trainer.save_freq=-1")
    assert str(err.value) == (
        "the reward failed on every sample of 200 groups in a row; fix the reward, then rerun "
        "to continue from step_1"
    )
    assert [c for c in session.calls if c[0] == "checkpoint"] == [("checkpoint", 1)]
    assert session.closed_failed is False  # the roles were alive: stopped, not killed
