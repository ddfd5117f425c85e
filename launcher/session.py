"""The roles of one run and their lifecycle: start, supervise, restart, checkpoint, close.

``Run`` owns the Ray actors (buffer, learner ranks, rollout fleet), starts them in
dependency order, restarts a dead buffer on its bank, rejoins replaced engines,
writes checkpoints and ends every role it started. The schedule that drives it
step by step is ``launcher.train.run``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from fleetrl.config import to_dict
from fleetrl.log import get_logger
from launcher.config import RunConfig
from launcher.delivery import group_id_for_index
from launcher.supervision import (
    Supervisor,
    TrainingStopped,
    checkpoint_candidates,
    gather,
    is_actor_death,
    listening_pid,
    make_run_secrets,
    retry_after_buffer_restart,
    write_roster,
)

log = get_logger(__name__)

STALL_WARN_S = 60.0  # warn when the learner has waited this long for one batch
MAX_BUFFER_RESTARTS = 5  # per run; a buffer that keeps dying stops the run
BUFFER_REBIND_ATTEMPTS = 20  # its old port may linger a moment after a kill -9
ROSTER_FILE = "roles.json"  # role -> pid, rewritten whenever a role is (re)started
BUFFER_ADDRESSES_FILE = "buffer_addresses.json"  # {"ingest", "control"}: for tools (the soak)


class StopRequested(Exception):
    """A stop signal arrived while waiting; the loop checkpoints and ends cleanly."""


class Run:
    """The roles of one run, created by ``start`` and ended by ``close`` (in that order).

    ``secure`` (default: whenever the run is not on a local Ray instance) gives every ZeroMQ
    socket CURVE keys and the engines a bearer API key, made fresh for this run.
    """

    def __init__(self, cfg: RunConfig, address: str | None, secure: bool | None = None):
        self.cfg = cfg
        self.address = address
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
        self.buffer_restarts = 0
        self.bank_dir = cfg.buffer.bank_dir or str(self.run_dir / "rollout_bank")
        self.learners: list[Any] = []
        self.rollout: Any = None
        self.step = 0
        self.version = 0
        self.resumed_from: str | None = None
        self.last_checkpoint_watermark: int | None = None
        # (hand-out watermark, prompts unfinished) of each checkpoint still resumable
        self.resumable: list[tuple[int, list[int]]] = []
        self.quarantined: set[str] = set()
        self.failed = False

    # ---- set-up ---------------------------------------------------------------------------
    def start(self) -> None:
        import ray

        from launcher.placement import bundle_options, init_ray, learner_placement_group
        from launcher.roles import LearnerRole, RolloutRole, remote_class

        cfg = self.cfg
        self.started_ray = init_ray(cfg, self.address)
        local = self.started_ray
        self.local = local
        self.secrets = make_run_secrets(not local if self.secure is None else self.secure)
        if self.secrets.secure:
            log.info("CURVE on every buffer socket and an API key on every engine (this run's)")
        self.set_aside_unowned_bank()
        ingest, control = self.start_buffer()

        pg = learner_placement_group(cfg)
        ray.get(pg.ready())
        learner_cls = remote_class(LearnerRole)
        world = cfg.learner.num_ranks
        self.learners = [
            learner_cls.options(**bundle_options(pg, r, cfg)).remote(self.raw, r, world, local)
            for r in range(world)
        ]
        for rank, w in enumerate(self.learners):
            self.supervisor.register(f"learner rank {rank}", w)
        master = ray.get(self.learners[0].master_address.remote())
        curve = self.secrets.learner_client
        gather([w.setup.remote(master, control, curve) for w in self.learners], "learner setup")

        extra: dict[str, Any] = {}
        if cfg.trainer.resume == "auto":
            extra = self.restore_latest_checkpoint()

        self.rollout = remote_class(RolloutRole, num_cpus=0, max_concurrency=16).remote(
            self.raw,
            ingest,
            control,
            str(self.run_dir),
            local,
            self.secrets.engine_api_key,
            self.secrets.rollout_client,
        )
        self.supervisor.register("rollout supervisor", self.rollout)
        urls = ray.get(self.rollout.start_engines.remote())
        key = self.secrets.engine_api_key
        ray.get(
            self.learners[0].connect_engines.remote([(n, u, key) for n, u in sorted(urls.items())])
        )
        self.write_roster()
        if extra.get("reader"):
            ray.get(self.rollout.load_reader_state.remote(extra["reader"]))
        # Engines serve only after they hold the learner's weights: after a resume these are
        # the restored ones (peers that skip this generate from stale weights or deadlock).
        sync = self.publish(self.version, restored=self.resumed_from is not None)
        if sync.get("weight_sync/num_failed"):
            raise TrainingStopped(f"initial weight sync failed: {sync}")
        ray.get(self.rollout.start_generation.remote())

    # ---- supervision ------------------------------------------------------------------------
    def start_buffer(self) -> tuple[str, str]:
        """Start (or restart, on the same bank and addresses) the buffer; its bound addresses."""
        import ray

        from launcher.roles import BufferRole, remote_class

        attempts = 1 if self.buffer_addresses is None else BUFFER_REBIND_ATTEMPTS
        for attempt in range(1, attempts + 1):
            self.buffer = remote_class(BufferRole, num_cpus=0).remote(
                self.raw,
                self.bank_dir,
                self.local,
                self.secrets.buffer_server,
                self.buffer_addresses,
            )
            try:
                addresses = tuple(ray.get(self.buffer.start.remote()))
                break
            except ray.exceptions.RayTaskError as err:  # address still in use: wait, retry
                ray.kill(self.buffer, no_restart=True)
                if attempt == attempts:
                    raise TrainingStopped(
                        f"buffer could not bind {self.buffer_addresses} again: {err}"
                    ) from err
                time.sleep(0.5)
        self.buffer_addresses = addresses  # fixed from now on: clients reconnect to them
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ingest, control = addresses
        write_roster(self.run_dir / BUFFER_ADDRESSES_FILE, {"ingest": ingest, "control": control})
        self.supervisor.register("buffer", self.buffer)
        return addresses

    def restart_buffer(self) -> None:
        """The buffer died: a new one reloads the bank; the fleet re-sends what it lacks."""
        import ray

        self.buffer_restarts += 1
        old = self.supervisor.roles["buffer"]
        ray.kill(old.actor, no_restart=True)
        self.start_buffer()
        ray.get(self.learners[0].announce_version.remote(self.version))
        resent = ray.get(self.rollout.buffer_restarted.remote())
        log.warning(
            "buffer restarted (%d) at %s from bank %s: %d trajectories re-sent by the fleet",
            self.buffer_restarts,
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
            state = ray.get(self.learners[0].state.remote())
            self.step, self.version = state["step"], state["policy_version"]
            self.resumed_from = str(candidate)
            watermark = int(extra.get("buffer", {}).get("received_watermark", 0))
            self.last_checkpoint_watermark = watermark
            self.resumable = [(watermark, _unfinished(extra.get("reader")))]
            reset = ray.get(self.learners[0].resume_buffer.remote(self.version, watermark))
            log.info(
                "resumed from %s: step %d, policy version %d, hand-out watermark %d, "
                "admission counter reset to %d groups",
                candidate,
                self.step,
                self.version,
                watermark,
                reset,
            )
            return extra
        if checkpoint_candidates(self.ckpt_root):
            raise TrainingStopped(
                f"no checkpoint under {self.ckpt_root} loads (see the errors above), and the "
                f"rollout bank {self.bank_dir} belongs to that run: fix or remove them to go on"
            )
        return {}

    def set_aside_unowned_bank(self) -> None:
        """A bank no checkpoint will resume (fresh start) is moved aside, not reloaded.

        Reloading it would serve an earlier run's groups and counters to a learner that
        starts again at version 0.
        """
        bank = Path(self.bank_dir)
        resuming = self.cfg.trainer.resume == "auto" and checkpoint_candidates(self.ckpt_root)
        if resuming or not bank.is_dir() or not any(bank.iterdir()):
            return
        aside = bank.with_name(f"{bank.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
        bank.rename(aside)
        log.warning("starting afresh: the earlier rollout bank was moved to %s", aside)

    def write_roster(self) -> None:
        """roles.json: role -> pid (engines too, on a local instance) for tests and the soak."""
        import ray

        roster: dict[str, Any] = dict(self.supervisor.pids())
        roster["driver"] = os.getpid()
        if self.local and self.rollout is not None:
            for name, url in ray.get(self.rollout.engine_urls.remote()).items():
                pid = listening_pid(int(url.rstrip("/").rsplit(":", 1)[1]))
                if pid is not None:
                    roster[name] = pid
        write_roster(self.run_dir / ROSTER_FILE, roster)

    def guarded(self, call: Any, what: str) -> Any:
        """Run ``call``; a dead buffer is restarted and ``call`` retried, other deaths stop."""
        import ray

        def attempt() -> Any:
            try:
                return call()
            except (ray.exceptions.RayError, TimeoutError) as err:
                self.supervisor.diagnose(err, what, self.resume_hint())  # raises

        try:
            return retry_after_buffer_restart(
                attempt, self.restart_buffer, what, MAX_BUFFER_RESTARTS - self.buffer_restarts
            )
        except TrainingStopped:
            self.failed = True
            raise

    def resume_hint(self) -> str:
        candidates = checkpoint_candidates(self.ckpt_root)
        where = f"from {candidates[0].name}" if candidates else "from the start (no checkpoint)"
        return f"rerun with the same trainer.output_dir and trainer.resume=auto to continue {where}"

    # ---- the pieces of a step ---------------------------------------------------------------
    def publish(self, version: int, restored: bool = False) -> dict[str, float]:
        self.version = version
        what = f"publishing version {version}"
        out = gather([w.publish.remote(version, restored) for w in self.learners], what)[0]
        if out.get("weight_sync/needs_resend"):
            # a failure mid-stream left survivors with partial weights: send the version again
            log.warning("version %d reached some engines partially; publishing it again", version)
            out = gather([w.publish.remote(version, restored) for w in self.learners], what)[0]
        return out

    def fetch_batch(self, check_stop: Any = None) -> float:
        """Block until learner rank 0 holds B whole groups; returns the seconds waited.

        ``check_stop`` (called between polls) may raise ``StopRequested`` to give up waiting.
        """
        import ray

        started = time.monotonic()
        warned = False
        while not ray.get(
            self.learners[0].fetch_batch.remote(self.cfg.data.train_batch_size, self.version)
        ):
            if check_stop is not None:
                check_stop()
            ray.get(self.rollout.check.remote())
            self.rejoin_restarted_engines()  # with every engine dead, waiting alone never ends
            waited = time.monotonic() - started
            if waited > STALL_WARN_S and not warned:
                warned = True
                log.warning(
                    "learner has waited %.0fs for a batch; rollout: %s",
                    waited,
                    ray.get(self.rollout.metrics.remote()),
                )
        return time.monotonic() - started

    def rejoin_restarted_engines(self) -> None:
        """Engines that were replaced, or that missed a version, get current weights first.

        A replaced engine (new process, new URL) and an engine weight sync dropped (it timed
        out or refused: paused, disconnected) take no requests until a publish of the current
        version reaches them; one still not answering stays out until the fleet's health
        checks replace it.
        """
        import ray

        key = self.secrets.engine_api_key
        restarted = ray.get(self.rollout.pending_restarts.remote())
        dropped = set(ray.get(self.learners[0].take_dropped_engines.remote())) - set(restarted)
        newly = sorted(dropped - self.quarantined)
        if newly:
            log.warning("engines %s missed a weight update: no requests until they catch up", newly)
            ray.get(self.rollout.quarantine.remote(newly))
        self.quarantined = (self.quarantined | dropped) - set(restarted)
        joining: dict[str, str] = dict(restarted)
        if self.quarantined:
            urls = ray.get(self.rollout.engine_urls.remote())
            for name in sorted(self.quarantined):
                if name in urls and ray.get(self.rollout.probe_engine.remote(name)):
                    joining[name] = urls[name]
        if not joining:
            return
        for name, url in sorted(joining.items()):
            log.info("engine %s at %s receives version %d before serving", name, url, self.version)
            ray.get(self.learners[0].add_engine.remote(name, url, key))
        self.publish(self.version)
        failed = set(ray.get(self.learners[0].take_dropped_engines.remote()))
        ready = sorted(set(joining) - failed)
        ray.get(self.rollout.mark_ready.remote(ready))
        self.quarantined = (self.quarantined - set(ready)) | failed
        if failed:
            ray.get(self.rollout.quarantine.remote(sorted(failed)))
        if restarted:
            self.write_roster()

    def checkpoint(self) -> str:
        """Write a checkpoint; commit the *previous* checkpoint's hand-outs in the buffer.

        Committing one checkpoint late keeps the fallback to the previous complete
        checkpoint possible (the buffer refuses to serve committed hand-outs again).
        """
        import ray

        extra = {"reader": ray.get(self.rollout.reader_state.remote()), "step": self.step}
        watermark = ray.get(self.learners[0].buffer_watermark.remote())
        paths = gather(
            [w.save_checkpoint.remote(str(self.ckpt_root), extra) for w in self.learners],
            "saving a checkpoint",
        )
        self.resumable.append((watermark, _unfinished(extra["reader"])))
        if self.last_checkpoint_watermark is not None:
            committed = self.last_checkpoint_watermark
            # checkpoints below the commit can no longer resume; the prompts the others list
            # unfinished may be generated again, so the buffer keeps knowing them (retention.py)
            self.resumable = [(w, u) for w, u in self.resumable if w >= committed]
            retain = sorted({group_id_for_index(i) for _, u in self.resumable for i in u})
            ray.get(self.learners[0].commit_buffer.remote(committed, retain))
        self.last_checkpoint_watermark = watermark
        log.info("checkpoint written: %s", paths[0])
        self.remove_old_checkpoints()
        return paths[0]

    def remove_old_checkpoints(self) -> None:
        """Keep the newest ``trainer.keep_checkpoints`` (at least 2) complete checkpoints."""
        import shutil

        keep = self.cfg.trainer.keep_checkpoints
        if keep <= 0:
            return
        for old in checkpoint_candidates(self.ckpt_root)[max(keep, 2) :]:
            log.info("removing old checkpoint %s (trainer.keep_checkpoints=%d)", old, keep)
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        import ray

        if self.failed:  # a role died: the others may be blocked on it; end them now
            self.supervisor.kill_all()
            if self.started_ray:
                ray.shutdown()
            return
        # learners first: weight sync leaves its group while the engines still answer
        for w in self.learners:
            _quietly(lambda w=w: ray.get(w.close.remote(), timeout=30), "learner close")
        if self.rollout is not None:
            _quietly(lambda: ray.get(self.rollout.stop.remote(), timeout=60), "rollout stop")
        if self.buffer is not None:
            _quietly(lambda: ray.get(self.buffer.stop.remote(), timeout=30), "buffer stop")
        if self.started_ray:
            ray.shutdown()


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
