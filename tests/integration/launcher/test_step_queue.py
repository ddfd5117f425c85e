"""A step's publish, policy snapshot and the next batch's fetch are queued on the learner
ranks with the step, on a real local Ray instance: each rank runs step → publish → snapshot
(→ rank 0's fetch, for the version the publish makes) in that order without the driver
between them, the driver's ``publish``, ``save_hf_snapshot`` and ``wait_for_batch`` read
those answers (no second call), and where any rank's step raised, nothing queued behind it
runs on any rank, and the step's retry queues it again.

The actors stand for the learner ranks and the rollout role: they record what ran, in order,
in their own process (the real roles are tested with the whole run in tests/e2e).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from launcher.config import load_run_config
from launcher.results import PublishResult, StepResult
from launcher.session import Run
from rollout_fleet.membership import WeightTargets


@ray.remote
class Rank:
    """A learner rank: its step fails while ``fail_steps`` > 0."""

    def __init__(self, fail_steps: int = 0) -> None:
        self.ran: list[tuple] = []
        self.fail_steps = fail_steps

    def step(self, version: int) -> StepResult:
        self.ran.append(("step", version))
        if self.fail_steps:
            self.fail_steps -= 1
            raise ConnectionError("the buffer did not answer")
        return StepResult.from_metrics(version, {"actor/pg_loss": 0.1})

    def publish(self, version, targets, restored=False, *after_steps) -> PublishResult:
        assert isinstance(targets, WeightTargets)  # resolved by Ray, not a reference
        assert all(isinstance(s, StepResult) for s in after_steps)
        self.ran.append(("publish", version, len(after_steps)))
        return PublishResult(version=version)

    def save_hf_snapshot(self, step: int, *after_steps) -> str:
        self.ran.append(("snapshot", step, len(after_steps)))
        return f"hf_snapshots/step_{step}"

    def wait_for_batch(self, num_groups: int, version: int, *after_steps, timeout_s=2.0) -> bool:
        self.ran.append(("fetch", version, len(after_steps)))
        return True

    def log(self) -> list[tuple]:
        return self.ran


@ray.remote
class Rollout:
    def weight_targets(self) -> WeightTargets:
        return WeightTargets()

    def weights_published(self, result: PublishResult) -> None:
        return None

    def rejoin_targets(self) -> None:
        return None


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(tmp_path: Path, ranks: list) -> Run:
    run = Run(load_run_config(None, [f"trainer.output_dir={tmp_path}"]), address=None)
    run.learners, run.rollout = ranks, Rollout.remote()
    return run


@pytest.mark.slow  # a local Ray instance: ~10 s
def test_publish_and_snapshot_run_behind_the_step_on_every_rank(local_ray, tmp_path):
    ranks = [Rank.remote(), Rank.remote()]
    run = _run(tmp_path, ranks)
    run.step(3, publish=True, snapshot_step=4, fetch_next=True)
    assert run.publish(4).version == 4
    assert run.save_hf_snapshot(4) == "hf_snapshots/step_4"
    assert run.wait_for_batch(4) < 1.0
    # each rank's calls, once each, in order, each after both ranks' steps; rank 0 fetches
    # the next step's batch for the version this step's publish made
    ran = [("step", 3), ("publish", 4, 2), ("snapshot", 4, 2)]
    assert ray.get(ranks[0].log.remote()) == [*ran, ("fetch", 4, 2)]
    assert ray.get(ranks[1].log.remote()) == ran
    # a snapshot outside a step (the policy before any update) is asked for on its own
    assert run.save_hf_snapshot(0) == "hf_snapshots/step_0"
    assert ray.get(ranks[1].log.remote())[-1] == ("snapshot", 0, 0)


@pytest.mark.slow
def test_a_failed_step_publishes_and_writes_nothing_and_its_retry_queues_again(local_ray, tmp_path):
    ranks = [Rank.remote(), Rank.remote(fail_steps=1)]  # the second rank's first step fails
    run = _run(tmp_path, ranks)
    with pytest.raises(ray.exceptions.RayTaskError, match="the buffer did not answer"):
        run.step(7, publish=True, snapshot_step=8, fetch_next=True)
    run.step(7, publish=True, snapshot_step=8, fetch_next=True)  # the retry after a buffer restart
    assert run.publish(8).version == 8 and run.save_hf_snapshot(8) == "hf_snapshots/step_8"
    run.wait_for_batch(8)
    # nothing ran behind the failed step, on either rank
    ran = [("step", 7), ("step", 7), ("publish", 8, 2), ("snapshot", 8, 2)]
    assert ray.get(ranks[0].log.remote()) == [*ran, ("fetch", 8, 2)]
    assert ray.get(ranks[1].log.remote()) == ran
