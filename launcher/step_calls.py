"""The role calls of one training step, as the schedule (``launcher.train.train_loop``) makes them.

Wait for a batch, step the learner ranks, publish the new version to the engines the
rollout role's membership names, bring back engines that wait for weights, snapshot,
validate, profile, collect the roles' reports.

A step's publish, its policy snapshot and the next step's batch fetch are queued on the
learner ranks with the step itself, each depending on every rank's step (Ray never runs a
call whose argument is a failed call's result): a rank goes from its update to the push,
the snapshot and the next batch without waiting for the driver between them, and where any
rank's step raised, no rank publishes, writes or fetches (a rank alone in a collective
would wait for the others forever). ``StepCalls`` is a part of ``Run``
(``launcher/session.py``), which owns the roles these calls reach and supervises every
call (``Run.supervised()``); it reads the ``Run`` attributes named in its docstring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fleetrl.log import get_logger
from launcher.results import PublishResult, StepResult, merge_publish_results
from launcher.supervision import TrainingStopped, gather
from rollout_fleet.membership import WeightTargets
from rollout_fleet.validation import Validation

log = get_logger(__name__)

STALL_WARN_S = 60.0  # warn when the learner has waited this long for one batch
QUEUED_DRAIN_S = 5.0  # calls queued behind a failed step fail at once; this bounds the wait


@dataclass
class Queued:
    """Calls queued on the learner ranks with a step: for ``key`` (the version a publish
    sends, the step a snapshot writes), one per rank; a publish's ``targets`` (a reference
    to the rollout role's answer)."""

    key: int
    calls: list[Any]
    targets: Any = None


def _quietly_read(call: Any) -> None:
    import ray

    try:
        ray.get(call, timeout=0)
    except Exception as err:  # noqa: BLE001 - the failed step reported the cause already
        log.debug("a call queued behind a failed step: %r", err)


class StopRequested(Exception):
    """A stop signal arrived while waiting; the loop checkpoints and ends cleanly."""


class RewardsFailing(StopRequested):
    """The reward failed on every sample for ``reward.max_failed_groups`` groups in a row:
    the run stops as on a signal (a checkpoint written), then exits non-zero with why."""


class StepCalls:
    """The step's role calls of ``Run``. It uses ``cfg``, ``learners``, ``rollout``,
    ``buffer``, ``version``, ``steps_taken``, ``published_to``, ``_ahead`` (replies asked
    for ahead of the call that reads them), ``write_roster()`` and ``resume_hint()``."""

    def publish(
        self, version: int, restored: bool = False, targets: WeightTargets | None = None
    ) -> PublishResult:
        """Push ``version`` to the membership's live engines (every learner rank streams,
        rank 0 sends); the membership records what each engine got."""
        import ray

        self.version = version
        what = f"publishing version {version}"
        everyone = targets is None  # not a rejoin's push to the engines behind only
        for attempt in range(2):
            queued = self._queued("publish", version) if everyone and not attempt else None
            if queued is not None:  # asked for with the step (``_queue_after_step``)
                targets, calls = ray.get(queued.targets), queued.calls
            else:
                if targets is None or attempt:
                    targets = ray.get(self.rollout.weight_targets.remote())
                calls = [w.publish.remote(version, targets, restored) for w in self.learners]
            out = merge_publish_results(gather(calls, what))
            if everyone:
                self._note_membership_change(targets, out)
            acknowledged = self.rollout.weights_published.remote(out)
            if everyone and self.steps_taken and not (restored or out.needs_resend):
                self._ask_rejoin_ahead()
            ray.get(acknowledged)
            if not out.needs_resend:
                break
            # a failure mid-stream left survivors with partial weights: send the version again
            log.warning("version %d reached some engines partially; publishing it again", version)
        return out

    def _note_membership_change(self, targets: WeightTargets, out: PublishResult) -> None:
        """``fleet/regroup_s``: a publish to every engine whose engines differ from the last
        one's formed the weight group again (an engine joined, left or was replaced); what
        that took, before the engines paused (SGLang's schedulers hold generation for it,
        the embedded engine does not)."""
        engines = frozenset(f"{t.name}#{t.incarnation}" for t in targets.engines)
        if self.published_to and engines != self.published_to:
            out.metrics["fleet/regroup_s"] = out.metrics.get("weight_sync/group_setup_s", 0.0)
        self.published_to = engines

    def wait_for_batch(self, version: int, check_stop: Any = None) -> float:
        """Block until learner rank 0 holds B whole groups; returns the seconds waited.

        ``check_stop`` (called between polls) may raise ``StopRequested`` to give up waiting.
        """
        import ray

        started = time.monotonic()
        warned = False
        queued = self._queued("batch", version)  # the fetch queued with the last step
        if queued is not None and gather(queued.calls, "fetching a batch")[0]:
            return time.monotonic() - started
        while not ray.get(
            self.learners[0].wait_for_batch.remote(self.cfg.data.train_batch_size, version)
        ):
            if check_stop is not None:
                check_stop()
            reason = ray.get(self.rollout.check.remote())
            if reason is not None:
                raise RewardsFailing(reason)
            problem = ray.get(self.rollout.fleet_failure.remote())
            if problem:  # an elastic fleet stayed below its minimum
                raise TrainingStopped(f"{problem}; {self.resume_hint()}")
            # with every engine dead, waiting alone never ends
            self._rejoin(ray.get(self.rollout.rejoin_targets.remote()))
            waited = time.monotonic() - started
            if waited > STALL_WARN_S and not warned:
                warned = True
                log.warning(
                    "learner has waited %.0fs for a batch; rollout: %s",
                    waited,
                    ray.get(self.rollout.metrics.remote()),
                )
        return time.monotonic() - started

    def step(
        self,
        version: int,
        publish: bool = False,
        snapshot_step: int | None = None,
        fetch_next: bool = False,
    ) -> StepResult:
        """One learner step on the batch rank 0 holds (collective over every rank); with it
        are queued, as the schedule asks, the publish of ``version + 1`` (``publish``), the
        policy snapshot of ``snapshot_step`` and rank 0's wait for the next step's batch
        (``fetch_next``); ``publish``, ``save_hf_snapshot`` and ``wait_for_batch`` then read
        their answers.

        Co-located runs: the engines give the devices to the learner first
        (``yield_devices``); the publish that follows gives them back.
        """
        if self.cfg.rollout.colocated:
            self.yield_devices()
        calls = [w.step.remote(version) for w in self.learners]
        self._queue_after_step(version, calls, publish, snapshot_step, fetch_next)
        result = gather(calls, "a learner step")[0]
        self.steps_taken += 1
        return result

    def _queue_after_step(
        self,
        version: int,
        steps: list[Any],
        publish: bool,
        snapshot_step: int | None,
        fetch_next: bool,
    ) -> None:
        """Queue this step's publish and snapshot behind it on every rank, and the next
        step's batch fetch on rank 0, each depending on every rank's step (``steps``). A
        retried step (after a buffer restart) queues them again: the first ones failed with
        it. Not for co-located runs, whose publish waits for the engines to take their
        memory back.

        The publish's targets are the membership's answer now, the one a publish right after
        the step would get a step's time earlier: an engine that joins meanwhile gets the
        version by ``rejoin_engines``, one that dies meanwhile fails this publish as it
        would any."""
        for name in ("publish", "snapshot", "batch"):
            self._drop_queued(name)
        if self.cfg.rollout.colocated:
            return
        if publish:
            targets = self.rollout.weight_targets.remote()
            calls = [w.publish.remote(version + 1, targets, False, *steps) for w in self.learners]
            self._ahead["publish"] = Queued(version + 1, calls, targets)
        if snapshot_step is not None:
            calls = [w.save_hf_snapshot.remote(snapshot_step, *steps) for w in self.learners]
            self._ahead["snapshot"] = Queued(snapshot_step, calls)
        if fetch_next:  # the version the next step trains against: this publish's
            following = version + 1 if publish else version
            fetch = self.learners[0].wait_for_batch.remote(
                self.cfg.data.train_batch_size, following, *steps
            )
            self._ahead["batch"] = Queued(following, [fetch])

    def _queued(self, name: str, key: int) -> Queued | None:
        """The calls queued with the step for ``key`` (a version, a step), taken once."""
        queued = self._ahead.get(name)
        if queued is None or queued.key != key:
            return None
        return self._ahead.pop(name)

    def _drop_queued(self, name: str) -> None:
        """Calls queued with a step that failed: they fail with it; their errors are read
        here, as nobody else will (Ray reports a failed result nobody read)."""
        import ray

        queued = self._ahead.pop(name, None)
        if queued is not None:
            ray.wait(queued.calls, num_returns=len(queued.calls), timeout=QUEUED_DRAIN_S)
            for call in queued.calls:
                _quietly_read(call)

    def yield_devices(self) -> None:
        """Co-located engines pause and release their memory (rollout_fleet/colocation.py)."""
        import ray

        ray.get(self.rollout.yield_devices.remote())

    def validate(self) -> Validation:
        """Score the held-out prompts with the current weights (greedy by default): the
        metrics, and the samples trainer.log_val_generations keeps."""
        import ray

        self._ahead.pop("reports", None)  # role_metrics reports after validation, not before
        return ray.get(self.rollout.validate.remote())

    def role_metrics(self) -> dict[str, float]:
        """What the rollout side and the buffer report after a step (for metrics.jsonl)."""
        import ray

        asked = self._ahead.pop("reports", None)
        rollout, buffer = asked if asked is not None else self._ask_reports()
        m = dict(ray.get(rollout))
        stats = ray.get(buffer)
        m.update({f"buffer/{k}": float(v) for k, v in stats.items()})
        m["buffer/size"] = m.get("buffer/size", m.get("buffer/ready_groups", 0.0))
        m["buffer/refused_stale"] = m.get("buffer/refused_stale", 0.0)
        return m

    def rejoin_engines(self) -> None:
        """Engines waiting for weights that answer now get the current version first.

        A replaced engine (new process) and one weight sync dropped (it timed out or
        refused: paused, disconnected) take no requests until a publish of the current
        version reaches them (the membership's NEEDS_WEIGHTS); one still not answering stays
        out until the fleet's health checks replace it.
        """
        import ray

        reports = self._ask_reports()  # asked together: role_metrics reads them after the step
        asked = self._ahead.pop("rejoin", None)
        if self._rejoin(
            ray.get(asked if asked is not None else self.rollout.rejoin_targets.remote())
        ):
            return
        self._ahead["reports"] = reports

    def _ask_rejoin_ahead(self) -> None:
        """Behind a step's publish acknowledgement, ask the rollout role which engines wait
        for weights (``rejoin_engines``, the schedule's next call, reads the answer): the role
        answers its caller's calls in order, so the answer counts this publish, and the step
        loses one round trip. Not for co-located engines (their publish returns devices)."""
        if not self.cfg.rollout.colocated:
            self._ahead["rejoin"] = self.rollout.rejoin_targets.remote()

    def _ask_reports(self) -> tuple[Any, Any]:
        """The rollout side's and the buffer's reports (``role_metrics``), asked for together."""
        return self.rollout.metrics.remote(), self.buffer.stats.remote()

    def _rejoin(self, targets: WeightTargets | None) -> bool:
        """Publish the current version to ``targets`` (``rejoin_targets``'s answer); whether
        there were any."""
        if targets is None:
            return False
        log.info("engines waiting for weights answer: publishing version %d again", self.version)
        self.publish(self.version, targets=targets)
        self.write_roster()  # a replacement is a new process
        return True

    def start_profile(self, step: int) -> None:
        """``trainer.profile_steps``: every learner rank and engine records from here."""
        import ray

        gather([w.start_profile.remote() for w in self.learners], "starting a profile")
        ray.get(self.rollout.profile_engines.remote(step, True))

    def stop_profile(self, step: int) -> list[str]:
        """End the recording; the learner ranks' trace files (the engines write their own)."""
        import ray

        paths = gather([w.stop_profile.remote(step) for w in self.learners], "writing profiles")
        engines = ray.get(self.rollout.profile_engines.remote(step, False))
        log.info("step %d profiled: %s, and engines %s", step, ", ".join(paths), engines or "none")
        return paths

    def save_hf_snapshot(self, step: int) -> str:
        """Write the policy of ``step`` as a Hugging Face folder (``trainer.save_hf_freq``);
        the snapshot queued with the step, where it was."""
        queued = self._queued("snapshot", step)
        calls = queued.calls if queued else [w.save_hf_snapshot.remote(step) for w in self.learners]
        return gather(calls, "writing a policy snapshot")[0]
