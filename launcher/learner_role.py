"""The learner role: one Ray actor per FSDP rank around ``learner.worker.LearnerWorker``.

Rank 0 also pulls the batches from the buffer (``BatchSource``, launcher/batch_source.py),
keeps the audit trail of the groups trained, and owns the weight publisher
(``WeightSender``, or ``AdapterSender`` with LoRA); the other ranks take part in every
collective call. Co-located runs hand the device to the engine between steps
(``LearnerColocation``, launcher/colocated_publish.py). See launcher/roles.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger, setup_logging
from fleetrl.profiling import TraceSpan, step_dir
from fleetrl.threads import role_threads
from launcher.config import RunConfig, resolve_device
from launcher.results import CheckpointRecord, PublishResult, StartRecord, StepResult
from launcher.roles import BUFFER_REPLY_TIMEOUT_S, free_port, node_ip, role_config
from launcher.sample_account import TRAINED_GROUPS_FILE  # the audit trail of learner steps
from rollout_fleet.membership import SyncOutcome, WeightTargets

log = get_logger(__name__)

BATCH_POLL_S = 2.0  # how long one fetch waits in the buffer before the driver looks around


class LearnerRole:
    """One FSDP rank of the learner group; rank 0 also feeds it batches and publishes weights."""

    def __init__(self, raw: dict[str, Any], rank: int, world_size: int, local: bool):
        cfg = role_config(raw)
        setup_logging(f"learner:{rank}", cfg.logging.level)
        import torch

        if cfg.trainer.device != "cuda":
            torch.set_num_threads(role_threads(cfg.learner.cpus_per_rank))
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.local = local
        self.worker: Any = None
        self.buffer: Any = None
        self.batches: Any = None  # rank 0: launcher.batch_source.BatchSource
        self.sender: Any = None  # rank 0: WeightSender or AdapterSender (weight_sync.publisher)
        self.engine_api_key: str | None = None
        self.device = resolve_device(cfg)
        self.lora = cfg.learner.lora.rank > 0  # publish adapter weights only
        self.colocation: Any = None  # co-located: launcher.colocated_publish.LearnerColocation

    def pid(self) -> int:
        return os.getpid()

    def master_address(self) -> tuple[str, int]:
        host = node_ip(self.local)
        return host, free_port(host)

    def setup(
        self,
        master: tuple[str, int],
        buffer_control: str,
        curve: Any = None,
        engine_api_key: str | None = None,
    ) -> None:
        from learner.worker import LearnerWorker

        self.engine_api_key = engine_api_key
        self.trace = TraceSpan()

        self.worker = LearnerWorker(
            self.cfg.learner,
            self.cfg.model,
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master[0],
            master_port=master[1],
            seed=self.cfg.trainer.seed,
            device=self.device,
            total_steps=self.cfg.trainer.total_steps,
            max_response_length=self.cfg.rollout.max_new_tokens,
        )
        self.worker.setup()
        if self.cfg.rollout.colocated:
            from launcher.colocated_publish import LearnerColocation

            self.colocation = LearnerColocation(self)
        from launcher.plan import learner_gb

        try:  # the plan for this device, logged beside the measured peak
            self._plan_gb = learner_gb(self.cfg)
        except (KeyError, ValueError, FileNotFoundError) as err:  # a config.json it cannot read
            log.warning("no memory plan for %s: %s", self.cfg.model.path, err)
            self._plan_gb = float("nan")
        if self.rank == 0:
            from buffer.transport import BufferClient
            from launcher.batch_source import BatchSource
            from weight_sync.sender import WeightSender

            self.buffer = BufferClient(
                buffer_control, curve=curve, timeout_s=BUFFER_REPLY_TIMEOUT_S
            )
            self.batches = BatchSource(self.buffer)
            if self.lora:
                from weight_sync.adapter_sender import AdapterSender

                self.sender = AdapterSender(
                    self.cfg.weight_sync,
                    adapter_dir=adapter_dir(self.cfg),
                    adapter_config=self.worker.adapter_config(),
                )
            else:
                self.sender = WeightSender(
                    self.cfg.weight_sync, master_address=node_ip(self.local), device=self.device
                )

    def offload(self) -> float:
        """Co-located runs: leave the device to the engine (before the engines start, and
        after every publish); seconds taken (0 on CPU)."""
        return self.colocation.offload() if self.colocation is not None else 0.0

    def _resident(self) -> Any:
        """The model on the device for the block (co-located runs offload it between steps)."""
        from contextlib import nullcontext

        return self.colocation.resident() if self.colocation is not None else nullcontext()

    # ---- checkpoints (collective) ---------------------------------------------------------
    def load_checkpoint(self, step_dir: str) -> dict[str, Any]:
        with self._resident():
            return self.worker.load_checkpoint(step_dir)

    def save_checkpoint(self, root: str, extra_state: dict[str, Any]) -> CheckpointRecord:
        watermark = -1
        if self.rank == 0:
            buffer_state = self.batches.state_dict()
            watermark = int(buffer_state["received_watermark"])
            extra_state = {**extra_state, "buffer": buffer_state}
        with self._resident():
            path = self.worker.save_checkpoint(root, extra_state)
        return CheckpointRecord(
            path=str(path),
            step=self.worker.global_step,
            policy_version=self.worker.policy_version,
            watermark=watermark,
        )

    def start_profile(self) -> None:
        """``trainer.profile_steps``: record this rank from here (fleetrl/profiling.py)."""
        self.trace.start()

    def stop_profile(self, step: int) -> str:
        """End the recording; write ``<run dir>/profile/step_<N>/learner_rank<r>.json``."""
        folder = step_dir(self.cfg.trainer.output_dir, step)
        return str(self.trace.stop(folder / f"learner_rank{self.rank}.json"))

    def save_hf_snapshot(self, step: int, *after_steps: StepResult) -> str:
        """Collective: the policy as a Hugging Face folder (learner/snapshot.py); rank 0 writes.
        ``after_steps``: the driver queues the call with a step, passing every rank's step
        call, so Ray runs it once they all returned (never if one raised); unused here."""
        from learner.snapshot import snapshot_root, write_hf_snapshot

        with self._resident():
            path = write_hf_snapshot(
                self.worker.named_full_tensors(),
                model_path=self.cfg.model.path,
                root=snapshot_root(self.cfg.trainer.output_dir),
                step=step,
                rank=self.rank,
            )
        return str(path)

    def state(self, resumed_from: str | None = None) -> StartRecord:
        return StartRecord(
            step=self.worker.global_step,
            policy_version=self.worker.policy_version,
            resumed_from=resumed_from,
        )

    # ---- rank 0: buffer and engines -------------------------------------------------------
    def resume_buffer(self, version: int, watermark: int) -> int:
        return self.buffer.resume(version, watermark)

    def buffer_watermark(self) -> int:
        """Hand-outs received and trained on (a batch held for the next step not counted)."""
        return int(self.batches.state_dict()["received_watermark"])

    def commit_buffer(
        self, watermark: int | None = None, retain_groups: list[str] | None = None
    ) -> None:
        if watermark is None:
            watermark = self.buffer_watermark()
        self.buffer.commit(watermark, retain_groups)

    def announce_version(self, version: int) -> None:
        """Tell a (restarted) buffer the version the engines hold: admission's clock."""
        self.buffer.publish_version(version)

    def wait_for_batch(
        self,
        num_groups: int,
        version: int,
        *after_steps: StepResult,
        timeout_s: float = BATCH_POLL_S,
    ) -> bool:
        """Wait up to ``timeout_s`` for a batch of whole groups; True once rank 0 holds one.
        ``after_steps``: as for ``save_hf_snapshot``, where the driver queued the wait with a
        step (the next step's batch, fetched while the driver logs this one)."""
        return self.batches.wait(num_groups, version, timeout_s)

    # ---- collective work --------------------------------------------------------------------
    def step(self, version: int) -> StepResult:
        """Collective: rank 0 takes its batch from the batch source and broadcasts it."""
        batch = self.batches.take() if self.rank == 0 else None
        onload_s = self.colocation.onload() if self.colocation is not None else None
        metrics = self.worker.step(batch, version)
        if onload_s is not None:
            metrics["colocate/onload_s"] = onload_s
        metrics["plan/learner_gb"] = self._plan_gb
        if self.rank == 0 and self.batches.last_info is not None:
            metrics["buffer/refused_stale_in_batch"] = float(self.batches.last_info.refused_stale)
            self._record_trained(batch, version)
        return StepResult.from_metrics(version, metrics)

    def _record_trained(self, batch: Any, version: int) -> None:
        """Append this step's groups to the run's audit trail (what was trained, exactly once)."""
        import json

        info = self.buffer.last_batch
        oldest = [min(v) if v else version for v in batch.column("token_versions").to_pylist()]
        record = {
            "step": self.worker.global_step,
            "policy_version": version,
            "handout_start": info.handout_start,
            "groups": list(dict.fromkeys(batch.column("group_id").to_pylist())),
            "num_samples": batch.num_rows,
            "max_staleness": max(version - v for v in oldest) if oldest else 0,
        }
        path = Path(self.cfg.trainer.output_dir) / TRAINED_GROUPS_FILE
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def publish(
        self, version: int, targets: WeightTargets, restored: bool = False, *after_steps: StepResult
    ) -> PublishResult:
        """Every rank drives the tensor stream (the adapter's with LoRA on, else the
        full weights); rank 0 broadcasts it to ``targets``
        (the rollout side's membership chose them) and reports what each got.
        ``after_steps``: as for ``save_hf_snapshot``, the step calls this publish follows."""
        from weight_sync.sender import WeightSyncError, drain_stream

        if self.colocation is not None:
            return self.colocation.publish(version, targets, restored)
        if self.lora:
            stream = self.worker.named_adapter_tensors()
        else:
            stream = self.worker.named_full_tensors()
        self.worker.policy_version = version
        if self.rank != 0:
            drain_stream(stream)
            return PublishResult(version=version)
        self.sender.set_members(self.endpoints(targets.engines))
        try:
            send = self.sender.publish_restored if restored else self.sender.publish
            metrics = send(stream, version)
            out = metrics.as_log_dict()
            out["timing_s/update_weights"] = metrics.total_s
            outcome = SyncOutcome(version=version, targets=targets.engines)
            result = PublishResult(
                version=version, outcome=outcome, seconds=metrics.total_s, metrics=out
            )
        except WeightSyncError as err:  # the engines named were dropped; the others hold v
            log.error("weight sync of version %d: %s", version, err)
            seconds = err.metrics.total_s if err.metrics is not None else 0.0
            out = err.metrics.as_log_dict() if err.metrics is not None else {}
            out["weight_sync/num_failed"] = float(len(err.engines))
            out["weight_sync/needs_resend"] = float(err.needs_resend)
            out["timing_s/update_weights"] = seconds
            statuses = err.metrics.engines if err.metrics is not None else {}
            failed = {
                n: (statuses[n].error if n in statuses and statuses[n].error else str(err))
                for n in err.engines
            }
            outcome = SyncOutcome(
                version=version,
                targets=targets.engines,
                failed=failed,
                partial=tuple(err.partial),
            )
            result = PublishResult(version=version, outcome=outcome, seconds=seconds, metrics=out)
            if err.needs_resend:
                return result  # survivors hold part of v: the driver sends v again first
        # admission's clock moves only once the engines (those still members) hold version v
        self.buffer.publish_version(version)
        return result

    def endpoints(self, targets: Any) -> list[Any]:
        """What the weight senders need of each ``EngineTarget``: URL, key, ranks, process, API."""
        from rollout_fleet.engine_api import engine_api
        from weight_sync.engine_client import EngineEndpoint

        return [
            EngineEndpoint(
                name=t.name,
                url=t.url,
                api_key=self.engine_api_key,
                world_size=self.cfg.rollout.tp_size,
                incarnation=t.incarnation,
                api=engine_api(self.cfg.rollout.backend),
            )
            for t in targets
        ]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.colocation is not None:
            self.colocation.close()
        if self.buffer is not None:
            self.buffer.close()
        if self.worker is not None:
            self.worker.close()


def adapter_dir(cfg: RunConfig) -> str:
    """Where LoRA adapter versions are written for the engines (``weight_sync.adapter_dir``)."""
    return cfg.weight_sync.adapter_dir or str(Path(cfg.trainer.output_dir).resolve() / "adapters")
