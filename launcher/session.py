"""The roles of one run and their lifecycle: start, supervise, restart, checkpoint, close.

``Run`` owns the Ray actors (buffer, learner ranks, rollout fleet), starts them in
dependency order, restarts a dead buffer on its bank, sends weights to engines that
wait for them, writes checkpoints and ends every role it started. Which engines may
serve is the rollout role's membership (rollout_fleet/membership.py): a publish takes
its targets from there and hands the outcome back, typed, with no names in between. Its
public methods are the role calls of the schedule (``launcher.train.train_loop``; those of
a step are in ``launcher/step_calls.py``): each carries its arguments, returns a typed
result (launcher/results.py) and is guarded by ``launcher.supervision.Supervised``
(``Run.supervised()``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetrl.config import to_dict
from fleetrl.log import get_logger
from launcher.config import RunConfig
from launcher.early_ray import EarlyRay, starts_local_instance
from launcher.fleet_control import make_control_keys, write_control_file
from launcher.laps import Laps
from launcher.results import CheckpointRecord, StartRecord
from launcher.step_calls import StepCalls, StopRequested
from launcher.supervision import (
    Supervised,
    Supervisor,
    TrainingStopped,
    checkpoint_candidates,
    gather,
    is_actor_death,
    listening_pid,
    make_run_secrets,
    write_engine_key,
    write_roster,
)
from rollout_fleet.delivery import group_id_for_index

log = get_logger(__name__)

BUFFER_REBIND_ATTEMPTS = 20  # its old port may linger a moment after a kill -9
ROSTER_FILE = "roles.json"  # role -> pid, rewritten whenever a role is (re)started
STARTUP_STOP_TIMEOUT_S = 30.0  # a stop during start-up: engines get this long to end
BUFFER_ADDRESSES_FILE = "buffer_addresses.json"  # {"ingest", "control"}: for tools (the soak)


class Run(StepCalls):
    """The roles of one run, created by ``start`` and ended by ``close`` (in that order).

    Every run makes a bearer API key that its engines and reward servers require
    (``<run dir>/secrets/engine_api_key`` holds it for the user's own requests); ``secure``
    (default: whenever the run is not on a local Ray instance) also gives every ZeroMQ
    socket CURVE keys, made fresh for this run.
    """

    def __init__(
        self,
        cfg: RunConfig,
        address: str | None,
        secure: bool | None = None,
        early_ray: EarlyRay | None = None,
    ):
        self.cfg = cfg
        self.address = address
        self.early_ray = early_ray  # a local instance already starting (launcher.early_ray)
        self.run_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.raw = to_dict(cfg)
        self.started_ray = False
        self.local = True
        self.secure = secure
        self.secrets = make_run_secrets(False)
        self.supervisor = Supervisor()
        self.buffer: Any = None
        self.buffer_addresses: tuple[str, str] | None = None
        self.bank_dir = cfg.buffer.bank_dir or str(self.run_dir / "rollout_bank")
        self.learners: list[Any] = []
        self.rollout: Any = None
        self.version = 0  # the version the engines hold (set by publish): rejoin and restart
        self.origin = StartRecord()
        self.last_checkpoint_watermark: int | None = None
        # (hand-out watermark, prompts unfinished) of each checkpoint still resumable
        self.resumable: list[tuple[int, list[int]]] = []
        self.failed = False
        self.placement_group: Any = None
        self.started = False  # every role up and serving: from here a stop checkpoints
        self.phase = "preparing"  # what start() is doing, for a stop's one-line message
        self.startup = Laps()  # seconds each phase of start() took
        self.control_file: Path | None = None  # fleet_control.json while the run listens
        self._control_client: Any = None  # the client keys `fleetrl fleet` reads from it
        self.published_to: frozenset[str] = frozenset()  # the engines of the last publish
        self.steps_taken = 0  # learner steps since step 0 (a resumed run counts from its own)
        # answers asked for ahead of the call that reads them (ObjectRefs), so that they
        # travel while the learner works: "publish", "snapshot" and "batch" (calls queued
        # with a step), "rejoin" (rejoin_engines's), "reports" (role_metrics's); a call reads
        # its own once and asks again after a fault
        self._ahead: dict[str, Any] = {}

    # ---- set-up ---------------------------------------------------------------------------
    def start(self, after_ray_init: Callable[[], None] | None = None) -> StartRecord:
        """Start every role in dependency order; engines serve once they hold the weights.

        ``after_ray_init`` runs once Ray is up (ray.init takes SIGTERM). A
        ``StopRequested`` raised at any point leaves the roles started so far for
        ``close`` to end.
        """
        import ray

        from launcher.learner_role import LearnerRole
        from launcher.placement import (
            bundle_options,
            learner_placement_group,
            wait_for_learner_group,
        )
        from launcher.roles import remote_class

        cfg = self.cfg
        local = self._start_ray(after_ray_init)
        # The roles' processes start side by side (each imports torch or Ray's client, seconds
        # of CPU): the buffer, the learner ranks once their bundles are placed, and the
        # rollout supervisor once the buffer has bound its addresses.
        self._enter("starting the buffer")
        buffer_bound = self._new_buffer()
        self._enter("placing the learner group")
        pg = self.placement_group = learner_placement_group(cfg)
        wait_for_learner_group(pg, cfg)
        self._enter("starting the learner and rollout processes")
        learner_cls = remote_class(LearnerRole)
        world = cfg.learner.num_ranks
        self.learners = [
            learner_cls.options(**bundle_options(pg, r, cfg)).remote(self.raw, r, world, local)
            for r in range(world)
        ]
        ingest, control = self._buffer_bound(buffer_bound)
        # Disaggregated engines need nothing from the learner to start: they start while the
        # learner group sets up (each is processes importing torch and building a model);
        # co-located ones wait for the learner to leave them its devices.
        engines_started = None if cfg.rollout.colocated else self.start_rollout(ingest, control)
        for rank, w in enumerate(self.learners):
            self.supervisor.register(f"learner rank {rank}", w)
        self._enter("setting up the learner group")
        master = ray.get(self.learners[0].master_address.remote())
        curve = self.secrets.learner_client
        key = self.secrets.engine_api_key
        gather(
            [w.setup.remote(master, control, curve, key) for w in self.learners], "learner setup"
        )

        extra: dict[str, Any] = {}
        self._enter("restoring the latest checkpoint")
        if cfg.trainer.resume_from_path:
            extra = self.restore_checkpoint_at(cfg.trainer.resume_from_path)
        elif cfg.trainer.resume == "auto":
            extra = self.restore_latest_checkpoint()

        if cfg.rollout.colocated:  # the engines start on the learner's devices: leave them room
            gather([w.offload.remote() for w in self.learners], "offloading the learner")
            engines_started = self.start_rollout(ingest, control)
        self._enter("placing and starting the engines")
        ray.get(engines_started)
        if extra.get("reader"):
            ray.get(self.rollout.load_reader_state.remote(extra["reader"]))
        self._first_weights_then_generate()
        self.started = True
        return self.origin

    def _start_ray(self, after_ray_init: Callable[[], None] | None) -> bool:
        """Ray up (a local instance unless an address is given), the run's keys made, the
        bank of an earlier run set aside; whether this run started Ray (it is local)."""
        from launcher.placement import init_ray

        cfg = self.cfg
        self._enter("starting Ray")
        # known before ray.init returns, so that close() ends a half-started local instance
        self.started_ray = starts_local_instance(cfg, self.address)
        try:
            if self.early_ray is not None and self.early_ray.begun:
                self.started_ray = self.early_ray.result()
            else:
                self.started_ray = init_ray(cfg, self.address)
        except SystemExit as err:  # Ray's own SIGTERM handler, in force while ray.init runs
            raise StopRequested("SIGTERM") from err
        if after_ray_init is not None:
            after_ray_init()
        self.local = self.started_ray
        self.secrets = make_run_secrets(not self.local if self.secure is None else self.secure)
        write_engine_key(self.run_dir, self.secrets.engine_api_key or "")  # for the user alone
        if self.secrets.secure:
            log.info("CURVE on every buffer socket (this run's keys)")
        self.set_aside_unowned_bank()
        return self.local

    def _first_weights_then_generate(self) -> None:
        """Engines serve only after they hold the learner's weights: after a resume these are
        the restored ones (peers that skip this generate from stale weights or deadlock).
        Then generation starts, and what only tools read is written while the first batch grows."""
        import ray

        self._enter("sending the first weights")
        sync = self.publish(self.version, restored=self.origin.resumed_from is not None)
        if sync.failed_engines or sync.needs_resend:
            raise TrainingStopped(
                f"initial weight sync of version {sync.version} failed for engines "
                f"{list(sync.failed_engines)}"
            )
        ray.get(self.rollout.start_generation.remote())
        self._enter("opening the fleet control")
        address = ray.get(self.rollout.serve_control.remote())  # `fleetrl fleet ...` reaches it
        self.control_file = write_control_file(self.run_dir, address, self._control_client)
        self.write_roster()
        self.steps_taken = self.origin.step
        self._enter("training")
        log.info("roles started in %s", self.startup.summary())

    def _enter(self, phase: str) -> None:
        """Start-up moves on to ``phase`` (a stop's message names it; ``startup`` times it)."""
        self.phase = phase
        self.startup.enter(phase)

    def start_rollout(self, ingest: str, control: str) -> Any:
        """Create the rollout role and ask it to start its engines; the pending start's ref."""

        from launcher.placement import wait_for_engine_room
        from launcher.roles import remote_class
        from launcher.rollout_role import RolloutRole

        cfg = self.cfg
        control_server, self._control_client = make_control_keys()  # the fleet control's keys
        self.rollout = remote_class(RolloutRole, num_cpus=0, max_concurrency=16).remote(
            self.raw,
            ingest,
            control,
            str(self.run_dir),
            self.local,
            self.secrets.engine_api_key,
            self.secrets.rollout_client,
            reward_api_key=cfg.reward.model.api_key(os.environ),  # read here: the driver's env
            placement_group=self.placement_group if cfg.rollout.colocated else None,
            control_keys=control_server,
        )
        if not self.local:
            wait_for_engine_room(cfg)
        started = self.rollout.start_engines.remote()  # queued now: runs once the actor is up
        self.supervisor.register("rollout supervisor", self.rollout)
        return started

    def supervised(self) -> Supervised:
        """This run's role calls, each guarded: a dead buffer restarted, other deaths stop."""
        import ray

        def diagnose(err: BaseException, what: str) -> None:
            self.supervisor.diagnose(err, what, self.resume_hint())

        return Supervised(
            self,
            diagnose=diagnose,
            restart_buffer=self.restart_buffer,
            faults=(ray.exceptions.RayError, TimeoutError),
        )

    # ---- supervision ------------------------------------------------------------------------
    def start_buffer(self) -> tuple[str, str]:
        """Start (or restart, on the same bank and addresses) the buffer; its bound addresses."""
        import ray

        attempts = 1 if self.buffer_addresses is None else BUFFER_REBIND_ATTEMPTS
        for attempt in range(1, attempts + 1):
            bound = self._new_buffer()
            try:
                return self._buffer_bound(bound)
            except ray.exceptions.RayTaskError as err:  # address still in use: wait, retry
                ray.kill(self.buffer, no_restart=True)
                if attempt == attempts:
                    raise TrainingStopped(
                        f"buffer could not bind {self.buffer_addresses} again: {err}"
                    ) from err
                time.sleep(0.5)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _new_buffer(self) -> Any:
        """Create the buffer actor (on the addresses it had, after a restart) and ask it to
        bind; the pending bind's ref (``_buffer_bound`` waits for it)."""
        from launcher.buffer_role import BufferRole
        from launcher.roles import remote_class

        self.buffer = remote_class(BufferRole, num_cpus=0).remote(
            self.raw,
            self.bank_dir,
            self.local,
            self.secrets.buffer_server,
            self.buffer_addresses,
        )
        return self.buffer.start.remote()

    def _buffer_bound(self, bound: Any) -> tuple[str, str]:
        """The buffer's bound addresses, once it serves (raises ``RayTaskError`` when it could
        not bind); recorded for the clients and tools, and the buffer supervised."""
        import ray

        addresses = tuple(ray.get(bound))
        self.buffer_addresses = addresses  # fixed from now on: clients reconnect to them
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ingest, control = addresses
        write_roster(self.run_dir / BUFFER_ADDRESSES_FILE, {"ingest": ingest, "control": control})
        self.supervisor.register("buffer", self.buffer)
        return addresses

    def restart_buffer(self, count: int = 1) -> None:
        """The buffer died: a new one reloads the bank; the fleet re-sends what it lacks."""
        import ray

        old = self.supervisor.roles["buffer"]
        ray.kill(old.actor, no_restart=True)
        self.start_buffer()
        ray.get(self.learners[0].announce_version.remote(self.version))
        # a fetch queued with the last step asked the buffer that died (it ran before the
        # call above): its answer is void; the next wait asks the new buffer
        self._drop_queued("batch")
        resent = ray.get(self.rollout.buffer_restarted.remote())
        log.warning(
            "buffer restarted (%d) at %s from bank %s: %d trajectories re-sent by the fleet",
            count,
            self.buffer_addresses,
            self.bank_dir,
            resent,
        )
        self.write_roster()

    def restore_latest_checkpoint(self) -> dict[str, Any]:
        """Load the newest complete checkpoint that loads; fall back to older ones on failure."""
        import ray

        for candidate in checkpoint_candidates(self.ckpt_root):
            try:
                extra = gather(
                    [w.load_checkpoint.remote(str(candidate)) for w in self.learners],
                    f"loading {candidate}",
                )[0]
            except ray.exceptions.RayTaskError as err:
                if is_actor_death(err):
                    raise
                log.error(
                    "checkpoint %s does not load (%s); falling back to the previous one",
                    candidate,
                    str(err).strip().splitlines()[-1][:300],
                )
                continue
            watermark = int(extra.get("buffer", {}).get("received_watermark", 0))
            self._resumed(candidate, extra, watermark)
            return extra
        if checkpoint_candidates(self.ckpt_root):
            raise TrainingStopped(
                f"no checkpoint under {self.ckpt_root} loads (see the errors above), and the "
                f"rollout bank {self.bank_dir} belongs to that run: fix or remove them to go on"
            )
        return {}

    def restore_checkpoint_at(self, path: str) -> dict[str, Any]:
        """``trainer.resume_from_path``: that checkpoint, with a new bank (launcher/resume_path.py)."""
        from launcher.resume_path import checkpoint_step, checkpoint_to_resume, set_aside_newer

        folder = checkpoint_to_resume(path)
        set_aside_newer(self.ckpt_root, checkpoint_step(folder))
        extra = gather(
            [w.load_checkpoint.remote(str(folder)) for w in self.learners], f"loading {folder}"
        )[0]
        self._resumed(folder, extra, watermark=0)  # the bank started empty
        return extra

    def _resumed(self, candidate: Path, extra: dict[str, Any], watermark: int) -> None:
        """After every rank loaded ``candidate``: the run's clock and the buffer follow it."""
        import ray

        self.origin = ray.get(self.learners[0].state.remote(str(candidate)))
        self.version = self.origin.policy_version
        self.last_checkpoint_watermark = watermark
        self.resumable = [(watermark, _unfinished(extra.get("reader")))]
        reset = ray.get(self.learners[0].resume_buffer.remote(self.version, watermark))
        log.info(
            "resumed from %s: step %d, policy version %d, hand-out watermark %d, "
            "admission counter reset to %d groups",
            candidate, self.origin.step, self.version, watermark, reset,
        )  # fmt: skip

    def set_aside_unowned_bank(self) -> None:
        """A bank no checkpoint will resume (fresh start) is moved aside, not reloaded.

        Reloading it would serve an earlier run's groups and counters to a learner that
        starts again at version 0.
        """
        bank = Path(self.bank_dir)
        trainer = self.cfg.trainer
        resuming = (
            trainer.resume == "auto"
            and not trainer.resume_from_path  # a chosen checkpoint starts a new bank
            and checkpoint_candidates(self.ckpt_root)
        )
        if resuming or not bank.is_dir() or not any(bank.iterdir()):
            return
        aside = bank.with_name(f"{bank.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
        bank.rename(aside)
        log.warning("starting afresh: the earlier rollout bank was moved to %s", aside)

    def write_roster(self) -> None:
        """roles.json: role -> pid (engines and reward servers too, on a local instance) for
        tests and the soak."""
        import ray

        roster: dict[str, Any] = dict(self.supervisor.pids())
        roster["driver"] = os.getpid()
        if self.local and self.rollout is not None:
            urls = ray.get(self.rollout.engine_urls.remote())
            urls.update(ray.get(self.rollout.reward_urls.remote()))  # placed reward servers
            for name, url in urls.items():
                pid = listening_pid(int(url.rstrip("/").rsplit(":", 1)[1]))
                if pid is not None:
                    roster[name] = pid
        write_roster(self.run_dir / ROSTER_FILE, roster)

    def resume_hint(self) -> str:
        candidates = checkpoint_candidates(self.ckpt_root)
        where = f"from {candidates[0].name}" if candidates else "from the start (no checkpoint)"
        return f"rerun with the same trainer.output_dir and trainer.resume=auto to continue {where}"

    def checkpoint(self, step: int) -> CheckpointRecord:
        """Write a checkpoint; commit the *previous* checkpoint's hand-outs in the buffer.

        Committing one checkpoint late keeps the fallback to the previous complete
        checkpoint possible (the buffer refuses to serve committed hand-outs again).
        """
        import ray

        self._ahead.pop("reports", None)  # role_metrics reports after the checkpoint
        extra = {"reader": ray.get(self.rollout.reader_state.remote()), "step": step}
        record = gather(
            [w.save_checkpoint.remote(str(self.ckpt_root), extra) for w in self.learners],
            "saving a checkpoint",
        )[0]
        self.resumable.append((record.watermark, _unfinished(extra["reader"])))
        if self.last_checkpoint_watermark is not None:
            committed = self.last_checkpoint_watermark
            # checkpoints below the commit can no longer resume; the prompts the others list
            # unfinished may be generated again, so the buffer keeps knowing them (retention.py)
            self.resumable = [(w, u) for w, u in self.resumable if w >= committed]
            retain = sorted({group_id_for_index(i) for _, u in self.resumable for i in u})
            ray.get(self.learners[0].commit_buffer.remote(committed, retain))
        self.last_checkpoint_watermark = record.watermark
        log.info("checkpoint written: %s", record.path)
        self.remove_old_checkpoints()
        return record

    def remove_old_checkpoints(self) -> None:
        """Keep the newest ``trainer.keep_checkpoints`` (at least 2) complete checkpoints."""
        import shutil

        keep = self.cfg.trainer.keep_checkpoints
        if keep <= 0:
            return
        for old in checkpoint_candidates(self.ckpt_root)[max(keep, 2) :]:
            log.info("removing old checkpoint %s (trainer.keep_checkpoints=%d)", old, keep)
            shutil.rmtree(old, ignore_errors=True)

    def close(self, failed: bool = False) -> None:
        """End every role; after a role died (``failed``) kill them, as they may be stuck."""
        try:
            self._close(failed)
        finally:
            if self.early_ray is not None:
                self.early_ray.end()

    def _close(self, failed: bool) -> None:
        import ray

        from launcher.placement import shutdown_local_ray

        self.forget_control_file()
        if not ray.is_initialized():  # ray.init did not complete
            if self.started_ray:
                shutdown_local_ray()
            return
        if not self.started and not (failed or self.failed):
            self.end_partial_start()
            return
        if failed or self.failed:  # a role died: the others may be blocked on it; end them now
            self.supervisor.kill_all()
            if self.started_ray:
                shutdown_local_ray()
            return
        # learners first: weight sync leaves its group while the engines still answer
        took = Laps()
        took.enter("learners")
        for w in self.learners:
            _quietly(lambda w=w: ray.get(w.close.remote(), timeout=30), "learner close")
        took.enter("rollout")
        if self.rollout is not None:
            _quietly(lambda: ray.get(self.rollout.stop.remote(), timeout=60), "rollout stop")
        took.enter("buffer")
        if self.buffer is not None:
            _quietly(lambda: ray.get(self.buffer.stop.remote(), timeout=30), "buffer stop")
        took.enter("Ray")
        if self.started_ray:
            shutdown_local_ray()
        log.info("roles ended in %s", took.summary())

    def forget_control_file(self) -> None:
        """The run stops listening: ``fleetrl fleet`` finds no endpoint to call."""
        if self.control_file is not None:
            self.control_file.unlink(missing_ok=True)
            self.control_file = None

    def end_partial_start(self) -> None:
        """A stop during start-up: end every role started so far, whatever its state.

        The rollout supervisor stops its engines first (an SGLang server is a process of its
        own, which killing its actor would leave behind); then every actor is killed and the
        learner placement group removed (actors still waiting for it go with it).
        """
        import ray
        from ray.util.placement_group import remove_placement_group

        from launcher.placement import shutdown_local_ray

        if self.rollout is not None:
            _quietly(
                lambda: ray.get(self.rollout.stop.remote(), timeout=STARTUP_STOP_TIMEOUT_S),
                "rollout stop",
            )
        actors = [h.actor for h in self.supervisor.roles.values()]
        actors += [*self.learners, self.rollout, self.buffer]
        for actor in {id(a): a for a in actors if a is not None}.values():
            _quietly(lambda a=actor: ray.kill(a, no_restart=True), "kill")
        if self.placement_group is not None:
            _quietly(
                lambda: remove_placement_group(self.placement_group), "placement group removal"
            )
        if self.started_ray:
            shutdown_local_ray()


def _unfinished(reader_state: Any) -> list[int]:
    """Prompt positions a checkpoint's delivery state lists as started but not accepted."""
    if not isinstance(reader_state, dict):
        return []
    return [int(i) for i in reader_state.get("unfinished_prompts", [])]


def _quietly(fn: Any, what: str) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - shutdown continues with the other roles
        log.warning("%s failed during shutdown: %r", what, err)
