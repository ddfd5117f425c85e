"""What the roles return to the driver: one typed result per cross-role call.

Control flow branches on these fields, never on metric keys; each result also
carries the float metrics of its call, which go to ``metrics.jsonl`` and
nowhere else. The structs cross Ray as ordinary return values (control calls,
not the data path: batches and trajectories travel over ZeroMQ).

- ``StepResult``: one learner step (from learner rank 0).
- ``PublishResult``: one weight-sync version: which engines failed, whether the
  survivors hold only part of it (``needs_resend``: the driver sends it again);
  ``merge_publish_results`` joins the ranks' results when each pushed to engines of
  its own (co-located runs).
- ``CheckpointRecord``: one checkpoint written, and the buffer watermark it
  covers.
- ``StartRecord``: where a run starts: fresh, or resumed from a checkpoint.
"""

from __future__ import annotations

import msgspec

from rollout_fleet.membership import SyncOutcome


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """One learner step, as learner rank 0 saw it."""

    policy_version: int  # the version the step trained against
    skipped_nonfinite: bool = False  # a non-finite loss or gradient: the update was skipped
    metrics: dict[str, float] = {}  # for logging only

    @classmethod
    def from_metrics(cls, version: int, metrics: dict[str, float]) -> StepResult:
        skipped = float(metrics.get("actor/skipped_nonfinite", 0.0)) > 0
        return cls(policy_version=version, skipped_nonfinite=skipped, metrics=dict(metrics))


class PublishResult(msgspec.Struct, frozen=True, kw_only=True):
    """One version pushed to the engines.

    ``outcome`` (learner rank 0 only) says what each target got; the rollout side's
    membership records it (``RolloutRole.weights_published``).
    """

    version: int
    outcome: SyncOutcome | None = None
    seconds: float = 0.0
    metrics: dict[str, float] = {}  # for logging only: weight_sync/* as metrics.jsonl names them

    @property
    def failed_engines(self) -> tuple[str, ...]:
        """Engines that missed ``version`` (dropped from this publish); the others hold it."""
        return tuple(sorted(self.outcome.failed)) if self.outcome is not None else ()

    @property
    def needs_resend(self) -> bool:
        """A failure mid-stream: some engines hold part of ``version``; send it again."""
        return self.outcome is not None and bool(self.outcome.partial)

    @property
    def complete(self) -> bool:
        """Every engine still a member holds ``version``."""
        return not self.needs_resend


def merge_publish_results(results: list[PublishResult]) -> PublishResult:
    """One publish's per-rank results as one: every rank's targets and failures (in a
    co-located run each rank pushes to the engines on its device); rank 0's metrics, with
    the ranks' ``colocate/*`` seconds at their slowest, bytes and engine counts summed."""
    first = results[0]
    outcomes = [r.outcome for r in results if r.outcome is not None]
    if len(outcomes) <= 1:
        return first
    metrics = dict(first.metrics)
    summed = ("weight_sync/num_engines", "weight_sync/num_failed")
    for other in results[1:]:
        for key, value in other.metrics.items():
            if not key.startswith("colocate/") and key not in summed:
                continue
            combine = sum if key.endswith("_bytes") or key in summed else max
            metrics[key] = combine((metrics.get(key, 0.0), value))
    outcome = SyncOutcome(
        version=first.version,
        targets=tuple(t for o in outcomes for t in o.targets),
        failed={name: why for o in outcomes for name, why in o.failed.items()},
        partial=tuple(name for o in outcomes for name in o.partial),
    )
    seconds = max(r.seconds for r in results)
    return PublishResult(version=first.version, outcome=outcome, seconds=seconds, metrics=metrics)


class CheckpointRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One checkpoint written by every learner rank."""

    path: str
    step: int
    policy_version: int
    watermark: int  # buffer hand-outs it covers (committed when the next one is written)


class StartRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Where the run starts: step 0, or the step and version of the checkpoint resumed."""

    step: int = 0
    policy_version: int = 0
    resumed_from: str | None = None
