"""The Ray actors of a run: one class per role, each a thin shell around the role's own code.

- ``BufferRole``   wraps ``buffer.service.BufferService`` (ZeroMQ ingest + control).
- ``LearnerRole``  one per FSDP rank, wraps ``learner.worker.LearnerWorker``; rank 0 also
                   pulls its batches from a ``BatchSource`` (launcher/batch_source.py)
                   and owns the weight publisher: ``WeightSender`` (full weights), or
                   ``AdapterSender`` (LoRA adapters only) when ``learner.lora.rank > 0``;
                   whom to send to arrives with each ``publish`` as ``WeightTargets``.
- ``RolloutRole``  an async actor hosting the engine ``Membership`` (the one owner of
                   "may engine-1 take requests?", rollout_fleet/membership.py), the engine
                   fleet (engine actors of its own), the router, the reward pipeline
                   (rule and reward-model scores, rollout_fleet/rewards/pipeline.py) with,
                   under ``reward.model``, its ``RewardServers`` (the urls, or a reward
                   fleet placed here: rollout_fleet/rewards/servers.py), and the asyncio
                   ``RolloutWorker`` that streams trajectories to the buffer.

Co-located runs (``rollout.placement: colocated``): engine i sits in learner rank i's
bundle; the rollout role's ``RolloutColocation`` (launcher/colocated_rollout.py) pauses
and releases the engines before each step (``yield_devices``) and resumes them around
the push; every learner rank pushes to its own engine by handle and moves its state off
the device while the engine generates (``LearnerColocation``, launcher/colocated_publish.py).

The classes are plain Python; ``remote_class(cls)`` applies ``ray.remote`` on demand so
importing this module needs no running Ray. Every actor receives the run config as
plain builtins (``msgspec.to_builtins``) and re-validates it. Calls the driver branches
on return typed results (launcher/results.py). Batches and trajectories
never travel through Ray: they go over ZeroMQ (msgspec / Arrow IPC) and, inside the
learner group, by broadcasting the Arrow bytes.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

from fleetrl.config import convert
from fleetrl.log import get_logger, setup_logging
from fleetrl.profiling import TraceSpan, step_dir
from fleetrl.threads import role_threads
from launcher.config import RunConfig, resolve_device
from launcher.results import CheckpointRecord, PublishResult, StartRecord, StepResult
from launcher.sample_account import TRAINED_GROUPS_FILE  # the audit trail of learner steps
from rollout_fleet.membership import SyncOutcome, WeightTargets
from rollout_fleet.validation import Validation

log = get_logger(__name__)

BATCH_POLL_S = 2.0  # how long one fetch waits in the buffer before the driver looks around
# A control request to a dead buffer fails after this long (the driver then restarts it);
# short, because the learner and the fleet are otherwise blocked on a buffer that is gone.
BUFFER_REPLY_TIMEOUT_S = 5.0
HEALTH_LOOP_RETRY_S = 1.0
RECONCILE_INTERVAL_S = 2.0  # how often the fleet asks which sent groups the buffer holds


def _config(raw: dict[str, Any]) -> RunConfig:
    return convert(RunConfig, raw)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip(local: bool) -> str:
    if local:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class BufferRole:
    """The buffer service. A restart passes the first start's addresses so clients reconnect."""

    def __init__(
        self,
        raw: dict[str, Any],
        bank_dir: str,
        local: bool,
        curve: Any = None,
        addresses: tuple[str, str] | None = None,
    ):
        from buffer.service import BufferService

        cfg = _config(raw)
        setup_logging("buffer", cfg.logging.level)
        host = node_ip(local)
        ingest, control = addresses or (f"tcp://{host}:0", f"tcp://{host}:0")
        self.service = BufferService(
            cfg.buffer,
            ingest_address=ingest,
            control_address=control,
            bank_dir=bank_dir,
            curve=curve,
            groups_per_version=cfg.groups_per_version,
            max_concurrent_groups=cfg.rollout.max_concurrent_groups,
        )

    def start(self) -> tuple[str, str]:
        return self.service.start()

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, float]:
        if self.service.failure is not None:
            raise RuntimeError(f"buffer service failed: {self.service.failure!r}")
        return self.service.stats()

    def stop(self) -> None:
        self.service.stop()


class LearnerRole:
    def __init__(self, raw: dict[str, Any], rank: int, world_size: int, local: bool):
        cfg = _config(raw)
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
            buffer_state = self.buffer.state_dict()
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

    def save_hf_snapshot(self, step: int) -> str:
        """Collective: the policy as a Hugging Face folder (learner/snapshot.py); rank 0 writes."""
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
        """Hand-outs received (and, after the step that used them, trained on)."""
        return int(self.buffer.state_dict()["received_watermark"])

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
        self, num_groups: int, version: int, timeout_s: float = BATCH_POLL_S
    ) -> bool:
        """Wait up to ``timeout_s`` for a batch of whole groups; True once rank 0 holds one."""
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
        self, version: int, targets: WeightTargets, restored: bool = False
    ) -> PublishResult:
        """Every rank drives the tensor stream (the adapter's with LoRA on, else the
        full weights); rank 0 broadcasts it to ``targets``
        (the rollout side's membership chose them) and reports what each got."""
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


class RolloutRole:
    """Async actor: engine fleet + router + rollout worker, on the rollout side of the cluster."""

    def __init__(
        self,
        raw: dict[str, Any],
        ingest: str,
        control: str,
        run_dir: str,
        local: bool,
        api_key: str | None = None,
        curve: Any = None,
        reward_api_key: str | None = None,
        placement_group: Any = None,
        control_keys: Any = None,
    ):
        from buffer.transport import BufferClient, TrajectorySender
        from rollout_fleet.fleet import EngineFleet
        from rollout_fleet.membership import Membership
        from rollout_fleet.rewards.pipeline import build_reward_pipeline
        from rollout_fleet.router import Router

        cfg = _config(raw)
        setup_logging("rollout", cfg.logging.level)
        self.cfg = cfg
        self.api_key = api_key
        self.run_dir = run_dir
        self.local = local
        self.control_keys = control_keys  # the fleet control endpoint's CURVE server keys
        self.scaling: Any = None  # launcher.elastic_rollout.RolloutScaling, once engines run
        # the tokenizer, the prompt reader and the delivery ledger over it: built while the
        # engines start (start_engines), as loading a tokenizer imports torch (seconds)
        self.tokenizer: Any = None
        self.reader: Any = None
        self.delivery: Any = None
        self.val_files = cfg.data.val_files
        self.gateway_host = node_ip(local)  # rollout.agent: where agents reach the gateway
        self._reader_args = cfg.data.reader_options()
        self.membership = Membership(suspect_cooldown_s=cfg.rollout.suspect_cooldown_s)
        self.router = Router(self.membership)
        self.colocation: Any = None  # co-located: launcher.colocated_rollout.RolloutColocation
        if cfg.rollout.colocated:
            from launcher.colocated_rollout import RolloutColocation

            self.colocation = RolloutColocation(
                cfg, self.membership, lambda: self.fleet.slot_names(), api_key
            )
        self.fleet = EngineFleet(
            cfg.rollout,
            cfg.model.path,
            membership=self.membership,
            device=resolve_device(cfg),
            dtype=cfg.model.dtype,
            api_key=api_key,
            expose_on_node_ip=not local,
            resource_name=cfg.ray.rollout_resource,
            weights_pushed=True,  # engines serve only once a publish reached them
            log_dir=str(Path(run_dir) / "logs"),
            pause_mode=cfg.weight_sync.pause_mode,
            lora_rank=cfg.learner.lora.rank,
            lora_target_modules=list(cfg.learner.lora.target_modules),
            actor_factory=(
                self.colocation.actor_factory(placement_group) if self.colocation else None
            ),
        )
        self.sender = TrajectorySender(ingest, curve=curve, hwm=cfg.buffer.high_water_mark)
        self.control = BufferClient(control, curve=curve, timeout_s=BUFFER_REPLY_TIMEOUT_S)
        self._health_task: asyncio.Task | None = None
        self._reconcile_task: asyncio.Task | None = None
        # the reward-model servers (reward.model.urls, or a reward fleet placed here) and
        # the pipeline that scores through their one client
        self.reward_servers = self._reward_servers(run_dir, local, reward_api_key)
        self.reward_client = self.reward_servers.client if self.reward_servers else None
        self.rewards = build_reward_pipeline(
            cfg.reward,
            timeout_s=cfg.rollout.reward_timeout_s,
            max_workers=cfg.rollout.reward_workers,
            model_servers=self.reward_client.servers if self.reward_client else {},
            reward_api_key=reward_api_key if cfg.reward.model.urls else api_key,
            engines=self.membership.urls,  # judge access: the engines serving now
            engine_api_key=api_key,
            client_factory=lambda servers, **_: self.reward_client,
        )
        self._reward_watch: asyncio.Task | None = None
        self.worker: Any = None
        self._task: asyncio.Task | None = None

    def _reward_servers(self, run_dir: str, local: bool, url_api_key: str | None) -> Any:
        """``reward.model``'s servers: its urls, or a reward fleet placed here (None without)."""
        from rollout_fleet.rewards.servers import RewardServers

        return RewardServers.for_run(
            self.cfg.reward,
            self.cfg.rollout,
            api_key=self.api_key,
            url_api_key=url_api_key,
            dtype=self.cfg.model.dtype,
            expose_on_node_ip=not local,
            resource_name=self.cfg.ray.reward_resource,
            log_dir=str(Path(run_dir) / "logs"),
        )

    async def _start_reward_servers(self) -> dict[str, str]:
        return await self.reward_servers.start() if self.reward_servers else {}

    async def yield_devices(self) -> int:
        """Co-located runs, before each learner step: the engines pause and release their
        memory (``rollout_fleet.colocation``); how many did."""
        return await self.colocation.yield_devices()

    def _load_prompts(self) -> None:
        """The tokenizer, the prompt reader, and the delivery ledger: groups are held until
        the buffer reports them accepted, re-sent after a buffer restart, re-queued after a
        learner resume; admission counts its sent groups as running (rollout_fleet/delivery.py)."""
        import launcher.elastic_rollout  # noqa: F401 - imported here, off the engines' path
        import rollout_fleet.worker  # noqa: F401
        from fleetrl.data.reader import PromptReader
        from fleetrl.models.loading import load_tokenizer
        from rollout_fleet.delivery import DeliveryLedger

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.reader = PromptReader(
            cfg.data.train_files,
            self.tokenizer,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
            max_samples=cfg.data.train_max_samples,
            **self._reader_args,
        )
        self.delivery = DeliveryLedger(self.reader, self.sender, self.control, cfg.rollout.n)

    async def start_engines(self) -> dict[str, str]:
        # the prompts (and the rollout loop's modules) load in a thread while the engine
        # processes start (both take seconds)
        urls, _, _ = await asyncio.gather(
            self.fleet.start(), self._start_reward_servers(), asyncio.to_thread(self._load_prompts)
        )
        from launcher.elastic_rollout import RolloutScaling
        from rollout_fleet.engine_api import rollout_client_class
        from rollout_fleet.worker import RolloutWorker

        engine_client_class = rollout_client_class(self.cfg.rollout.backend)
        cfg = self.cfg
        self.scaling = RolloutScaling(
            cfg,
            fleet=self.fleet,
            router=self.router,
            reward_servers=self.reward_servers,
            api_key=self.api_key,
        )
        self.worker = RolloutWorker(
            cfg.rollout,
            engines={
                n: engine_client_class(
                    u, api_key=self.api_key, timeout_s=cfg.rollout.request_timeout_s
                )
                for n, u in urls.items()
            },
            router=self.router,
            reader=self.delivery.prompts(),
            sender=self.delivery,
            admission_source=self.control.admission,
            ledger=self.delivery,
            rewards=self.rewards,
            tokenizer=self.tokenizer,
            client_factory=lambda url: engine_client_class(
                url, api_key=self.api_key, timeout_s=cfg.rollout.request_timeout_s
            ),
            lora=cfg.learner.lora.rank > 0,
            # elastic: the concurrency cap follows the engines serving (admission's capacity)
            serving_share=self.scaling.serving_share if cfg.rollout.elastic else None,
            max_prompt_tokens=cfg.data.max_prompt_length,
            gateway_host=self.gateway_host,
            max_failed_reward_groups=cfg.reward.max_failed_groups,
        )
        return urls

    async def serve_control(self) -> str:
        """Start the fleet control endpoint (``fleetrl fleet status|scale``); its address."""
        return self.scaling.serve(self.control_keys, node_ip(self.local))

    async def start_generation(self) -> None:
        self.scaling.start()  # elastic fleets follow the cluster from here
        self._task = asyncio.create_task(self.worker.run())
        self._health_task = asyncio.create_task(self._watch_engines())
        self._reconcile_task = asyncio.create_task(self._reconcile_loop())
        if self.reward_servers is not None:
            self._reward_watch = asyncio.create_task(self.reward_servers.watch())

    async def _watch_engines(self) -> None:
        """The fleet's health checks: dead or hung engines are replaced (see fleet.py)."""
        while True:
            try:
                await self.fleet.run_health_checks()
                return
            except (OSError, RuntimeError, ValueError) as err:
                log.error("engine health check round failed: %r; retrying", err)
                await asyncio.sleep(HEALTH_LOOP_RETRY_S)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            await self.reconcile()

    async def reconcile(self) -> int:
        """Forget groups the buffer holds whole; count (not raise) a buffer that is away."""
        from buffer.transport import BufferRequestError, BufferTimeout

        try:
            return await asyncio.to_thread(self.delivery.reconcile)
        except (BufferTimeout, BufferRequestError) as err:
            log.warning("delivery reconcile: buffer not answering (%s)", err)
            return -1

    async def buffer_restarted(self) -> int:
        """The buffer came back on the same addresses: re-send what it had not accepted."""
        return await asyncio.to_thread(self.delivery.resend_unconfirmed)

    async def pid(self) -> int:
        return os.getpid()

    async def engine_urls(self) -> dict[str, str]:
        return self.fleet.urls()

    async def reward_urls(self) -> dict[str, str]:
        """The reward servers this role placed and scores on now (name -> URL; empty with
        reward.model.urls or without a reward model)."""
        fleet = self.reward_servers.fleet if self.reward_servers is not None else None
        return fleet.servers() if fleet is not None else {}

    async def check(self) -> str | None:
        """Raise if the generation loop died; why the run should stop, if it should (its
        reward failed on every sample of ``reward.max_failed_groups`` groups in a row)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            err = self._task.exception()
            if err is not None:
                raise RuntimeError(f"rollout loop failed: {err!r}") from err
        return self.worker.reward_streak.stop_reason if self.worker is not None else None

    async def fleet_failure(self) -> str:
        """Why the run must stop for its fleets ("" when nothing is wrong): an elastic fleet
        below its minimum for longer than ray.placement_timeout_s."""
        return self.scaling.failure() if self.scaling is not None else ""

    async def weight_targets(self) -> WeightTargets:
        """The engines the next publish goes to: every live one, but those waiting for
        weights that do not answer now (a hung or paused engine would stall the publish
        until its timeout; the fleet's health checks replace it if it never answers).
        Co-located engines get their weight memory back first."""
        targets = await self._ready_to_receive((await self._answering_targets())[0])
        return self.membership.begin_sync(targets)

    async def rejoin_targets(self) -> WeightTargets | None:
        """Targets for a publish of the current version when an engine that waits for
        weights answers now (a replacement, a joiner, one that missed a version); else None.

        Only those engines: the others keep generating while the joiners load the version
        (they enter the others' weight group at the next publish, formed before that
        publish pauses anyone). Co-located and LoRA runs send to every live engine, as
        their pushes pause no one that holds the version (LoRA) or go by device (co-located).
        """
        targets, joining = await self._answering_targets()
        if not joining:
            return None
        if self.colocation is None and self.cfg.learner.lora.rank == 0:
            behind = set(self.membership.behind())
            targets = WeightTargets(engines=tuple(t for t in targets.engines if t.name in behind))
        return self.membership.begin_sync(await self._ready_to_receive(targets, rejoin=True))

    async def _ready_to_receive(
        self, targets: WeightTargets, rejoin: bool = False
    ) -> WeightTargets:
        """Co-located runs: the targets tagged with their device ranks, the released ones
        with their weight memory resumed (``launcher.colocated_rollout``)."""
        if self.colocation is None:
            return targets
        return await self.colocation.ready_to_receive(targets, rejoin=rejoin)

    async def _answering_targets(self) -> tuple[WeightTargets, bool]:
        behind = self.membership.behind()
        answers = await asyncio.gather(*(self._answers(n) for n in behind))
        silent = {n for n, ok in zip(behind, answers, strict=True) if not ok}
        return self.membership.weight_targets(exclude=silent), len(silent) < len(behind)

    async def weights_published(self, result: PublishResult) -> None:
        """A publish reached (or failed) its targets: the membership records what each holds
        (co-located engines that hold it resume and continue first)."""
        if result.outcome is not None:
            outcome = result.outcome
            if self.colocation is not None:
                outcome = await self.colocation.take_back(outcome)
            self.membership.apply_sync(outcome)
        if self.worker is not None:
            self.worker.admission_changed()  # the buffer counts the new version already

    async def _answers(self, name: str, timeout_s: float = 2.0) -> bool:
        """Whether engine ``name`` answers GET /health now (after a pause or a lost connection)."""
        from rollout_fleet.engine_api import rollout_client_class

        engine_client_class = rollout_client_class(self.cfg.rollout.backend)
        url = self.fleet.urls().get(name)
        if not url:
            return False
        client = engine_client_class(url, api_key=self.api_key, timeout_s=timeout_s, retries=0)
        try:
            return bool(await asyncio.wait_for(client.health(), timeout_s))
        except (TimeoutError, OSError):
            return False
        finally:
            await client.close()

    async def metrics(self) -> dict[str, float]:
        out = dict(self.worker.metrics()) if self.worker else {}
        out.update(self.fleet.metrics())
        if self.scaling is not None:
            out.update(self.scaling.metrics())
        if self.colocation is not None:
            out.update(self.colocation.metrics())
        if self.delivery is not None:  # built by start_engines
            out.update(self.delivery.metrics())
        if self.reward_servers is not None:
            out.update(self.reward_servers.metrics())
        return out

    async def validate(self) -> Validation:
        from fleetrl.data.reader import PromptReader

        if not self.val_files:
            return Validation()
        reader = PromptReader(self.val_files, self.tokenizer, shuffle=False, **self._reader_args)
        return await self.worker.validate(
            reader.iter_once(self.cfg.data.val_max_samples),
            keep_samples=self.cfg.trainer.log_val_generations,
            sample_seed=self.cfg.data.seed,
        )

    async def profile_engines(self, step: int, start: bool) -> list[str]:
        """SGLang's /start_profile or /stop_profile on every engine (their traces go to
        ``<run dir>/profile/step_<N>/engine_<name>.json`` on the engine's node); the engines
        that answered. Profiling is best effort: an engine that refuses is logged, not fatal."""
        from rollout_fleet.client import EngineError
        from rollout_fleet.engine_api import rollout_client_class

        engine_client_class = rollout_client_class(self.cfg.rollout.backend)
        folder = str(step_dir(Path(self.run_dir).resolve(), step))
        gpu = resolve_device(self.cfg) == "cuda"
        answered = []
        for name, url in sorted(self.fleet.urls().items()):
            client = engine_client_class(url, api_key=self.api_key, timeout_s=60.0, retries=0)
            try:
                await (
                    client.start_profile(folder, "engine_", gpu) if start else client.stop_profile()
                )
                answered.append(name)
            except EngineError as err:
                log.warning("engine %s: no profile for step %d: %s", name, step, err)
            finally:
                await client.close()
        return answered

    async def reader_state(self) -> dict[str, Any]:
        """The reader's cursor plus the prompts started but not yet accepted by the buffer."""
        from buffer.transport import BufferRequestError, BufferTimeout

        try:
            await asyncio.to_thread(self.delivery.reconcile)
        except (BufferTimeout, BufferRequestError) as err:  # keep more unfinished: safe
            log.warning("reader state without a fresh reconcile: %s", err)
        return self.delivery.state_dict()

    async def load_reader_state(self, state: dict[str, Any]) -> None:
        self.delivery.load_state_dict(state)

    async def stop(self, deadline_s: float = 5.0) -> None:
        if self.scaling is not None:  # no engine joins or leaves from here on
            await self.scaling.stop()
        for task in (self._health_task, self._reconcile_task, self._reward_watch):
            if task is not None:
                task.cancel()
        if self.worker is not None:
            await self.worker.stop(deadline_s)
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
            await self.worker.aclose()
        await self.rewards.aclose()
        await self.fleet.stop()
        if self.reward_servers is not None:
            await self.reward_servers.stop()
        if self.colocation is not None:
            await self.colocation.close()
        self.sender.close()
        self.control.close()


def adapter_dir(cfg: RunConfig) -> str:
    """Where LoRA adapter versions are written for the engines (``weight_sync.adapter_dir``)."""
    return cfg.weight_sync.adapter_dir or str(Path(cfg.trainer.output_dir).resolve() / "adapters")


def remote_class(cls: type, **options: Any) -> Any:
    import ray

    return ray.remote(**options)(cls) if options else ray.remote(cls)
