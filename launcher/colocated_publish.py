"""A learner rank's part of a co-located run (``rollout.placement: colocated``): its pushes.

``LearnerColocation`` is what ``launcher.learner_role.LearnerRole`` holds in a co-located run:
the rank's ``learner.offload.DeviceResidency`` (its state off the GPU while the engine
generates) and its ``weight_sync.tensor_push.TensorSender``, and the rank's publish.

Every rank streams the full weights (``named_full_tensors``, a collective) and pushes
them by handle to the engines that share its device (``EngineTarget.device_rank``),
through its ``weight_sync.tensor_push.TensorSender``. Rank 0 also broadcasts the same
stream to engines on their own devices (``device_rank`` -1), if the targets hold any,
through the ``WeightSender``: the tensor sender taps the stream the broadcast consumes,
so the weights are gathered once. The stream needs the weights on the device, so the
rank onloads its models first (``learner.offload``; the optimizer state stays on the
host) and offloads after the push, leaving the device
to its engine until the next step; the push's two staging buffers are freed at its end
(``colocate/staging_bytes`` says what they held).

Each rank returns what its own targets got (``SyncOutcome``); the driver merges the
ranks' results (``launcher.results.merge_publish_results``). Rank 0 then tells the
buffer the version (admission's clock) unless the broadcast left survivors with part of
it; co-located engines are routed to again only once the rollout side has resumed
them, after the driver has every rank's result (``rollout_fleet.colocation``).
"""

from __future__ import annotations

from typing import Any

from fleetrl.log import get_logger
from launcher.results import PublishResult
from rollout_fleet.membership import SyncOutcome, WeightTargets
from weight_sync.errors import WeightSyncError, drain_stream
from weight_sync.metrics import SyncMetrics

log = get_logger(__name__)


def _failures(err: WeightSyncError) -> dict[str, str]:
    statuses = err.metrics.engines if err.metrics is not None else {}
    return {
        n: (statuses[n].error if n in statuses and statuses[n].error else str(err))
        for n in err.engines
    }


class LearnerColocation:
    """A co-located rank's residency and push sender (``role``: a set-up ``LearnerRole``)."""

    def __init__(self, role: Any) -> None:
        from learner.offload import residency_for
        from weight_sync.tensor_push import TensorSender

        self.role = role
        cfg = role.cfg
        self.residency = residency_for(role.worker, enabled=cfg.rollout.colocate.offload_learner)
        self.tensor_sender = TensorSender(
            cfg.weight_sync, device=role.device, tp_size=cfg.rollout.tp_size
        )

    def offload(self) -> float:
        return self.residency.offload()

    def onload(self) -> float:
        return self.residency.onload()

    def resident(self) -> Any:
        return self.residency.resident()

    def publish(self, version: int, targets: WeightTargets, restored: bool) -> PublishResult:
        return publish_colocated(self.role, self, version, targets, restored)

    def close(self) -> None:
        self.tensor_sender.close()


def publish_colocated(
    role: Any, colocation: LearnerColocation, version: int, targets: WeightTargets, restored: bool
) -> PublishResult:
    """This rank's push of ``version`` (``role``: a set-up ``launcher.learner_role.LearnerRole``)."""
    onload_s = colocation.residency.onload(optimizers=False)  # the push reads weights only
    stream = role.worker.named_full_tensors()
    role.worker.policy_version = version
    mine = [t for t in targets.engines if t.device_rank == role.rank]
    remote = [t for t in targets.engines if t.device_rank < 0] if role.rank == 0 else []
    colocation.tensor_sender.set_members(role.endpoints(mine))
    push = colocation.tensor_sender.start(version, verify=True if restored else None)
    tapped = push.tap(stream)
    failed: dict[str, str] = {}
    partial: list[str] = []
    metrics: dict[str, float] = {}
    if remote:
        role.sender.set_members(role.endpoints(remote))
        send = role.sender.publish_restored if restored else role.sender.publish
        try:
            metrics.update(send(tapped, version).as_log_dict())
        except WeightSyncError as err:  # the sender drained the rest of the stream
            log.error("weight sync of version %d to remote engines: %s", version, err)
            failed.update(_failures(err))
            partial = list(err.partial)
            if err.metrics is not None:
                metrics.update(err.metrics.as_log_dict())
    else:
        drain_stream(tapped)
    try:
        pushed: SyncMetrics | None = push.finish()
    except WeightSyncError as err:
        log.error("version %d by handle: %s", version, err)
        failed.update(_failures(err))
        pushed = err.metrics
    offload_s = colocation.residency.offload()
    push_s = pushed.total_s if pushed is not None else 0.0
    metrics.update(
        {
            "colocate/push_s": push_s,
            "colocate/push_bytes": float(pushed.bytes if pushed is not None else 0),
            "colocate/push_gbps": pushed.gbps if pushed is not None else 0.0,
            # the two staging buffers, freed after the push (the engine generates next)
            "colocate/staging_bytes": float(push.staging_bytes),
            "colocate/onload_s": onload_s,
            "colocate/offload_s": offload_s,
            # both paths together: this rank's targets, and those that missed the version
            "weight_sync/num_engines": float(len(mine) + len(remote)),
            "weight_sync/num_failed": float(len(failed)),
        }
    )
    metrics["weight_sync/seconds"] = max(push_s, metrics.get("weight_sync/total_s", 0.0))
    outcome = SyncOutcome(
        version=version, targets=tuple(mine + remote), failed=failed, partial=tuple(partial)
    )
    result = PublishResult(
        version=version, outcome=outcome, seconds=metrics["weight_sync/seconds"], metrics=metrics
    )
    if role.rank == 0 and not result.needs_resend:
        role.buffer.publish_version(version)  # admission's clock
    return result
