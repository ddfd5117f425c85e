"""The rollout role: the async Ray actor that generates, scores and streams trajectories.

It hosts the engine ``Membership`` (rollout_fleet/membership.py), the engine fleet, the
router, the reward pipeline with its ``RewardServers`` (rollout_fleet/rewards/servers.py),
the delivery ledger over the prompt reader, and the ``RolloutWorker`` that streams
trajectories to the buffer; elastic fleets scale through ``RolloutScaling``
(launcher/elastic_rollout.py), co-located ones through ``RolloutColocation``
(launcher/colocated_rollout.py). See launcher/roles.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger, setup_logging
from fleetrl.profiling import step_dir
from launcher.config import resolve_device
from launcher.results import PublishResult
from launcher.roles import BUFFER_REPLY_TIMEOUT_S, node_ip, role_config
from rollout_fleet.membership import WeightTargets
from rollout_fleet.validation import Validation

log = get_logger(__name__)

HEALTH_LOOP_RETRY_S = 1.0
RECONCILE_INTERVAL_S = 2.0  # how often the fleet asks which sent groups the buffer holds


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

        cfg = role_config(raw)
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
