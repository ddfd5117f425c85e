"""`fleetrl train`: the one schedule of an asynchronous (or, with η = 0, synchronous) RL run.

Data flow (every arrow is a message; nothing is pickled on the data path)::

    PromptReader ─prompts─► RolloutWorker ──requests──► engines (embedded / SGLang, HTTP)
         ▲                    │  ▲  admission: start a group only while                │
         │ cursor saved       │  │  accepted + running < (η + v + 1)·B  (buffer counters)│
         │ in checkpoints     │  └────────────────────────────── BufferService ◄──────┘
         │                    │ trajectories (msgspec, ZMQ PUSH; blocks at the HWM =      ▲
         │                    ▼  backpressure when the buffer is full)                    │
         │               BufferService: whole groups, durable bank, refuses samples older │
         │                    │          than η at hand-out (safety net, should be 0)     │
         │                    │ GetBatch(B groups, v) ─ Arrow IPC ─► learner rank 0        │
         │                    ▼                                      │ broadcast bytes    │
         │               LearnerRole × N (FSDP2): PPO/GRPO step with off-policy corrections
         │                    │ every sync_every steps: v += 1                            │
         │                    ▼                                                           │
         │               WeightSender: pause engines → bucketed broadcast (gloo / NCCL) ──┘
         │                              → continue; PublishVersion(v) to the buffer
         └── this loop: fetch, step, publish, validate, checkpoint, log

Who waits for whom: the learner waits for B whole groups (``trainer/idle_fraction``);
the fleet waits for admission, which opens B more groups per published version
(``rollout/idle_fraction``); a full buffer blocks the fleet's sends. With
``buffer.max_staleness = 0`` admission lets exactly one version's batch be in
flight, which is synchronous on-policy training, by the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from fleetrl.config import to_dict
from fleetrl.log import get_logger
from launcher.config import RunConfig, load_run_config
from launcher.prepare import prepare
from launcher.report import summary_lines, write_score_plot
from launcher.supervision import (
    BadStepGuard,
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
from launcher.tracking import Tracker

log = get_logger(__name__)

STALL_WARN_S = 60.0  # warn when the learner has waited this long for one batch
MAX_BUFFER_RESTARTS = 5  # per run; a buffer that keeps dying stops the run
BUFFER_REBIND_ATTEMPTS = 20  # its old port may linger a moment after a kill -9
ROSTER_FILE = "roles.json"  # role -> pid, rewritten whenever a role is (re)started

__all__ = ["Run", "TrainingStopped", "main", "run"]


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
        return {}

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

    def fetch_batch(self) -> float:
        """Block until learner rank 0 holds B whole groups; returns the seconds waited."""
        import ray

        started = time.monotonic()
        warned = False
        while not ray.get(
            self.learners[0].fetch_batch.remote(self.cfg.data.train_batch_size, self.version)
        ):
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
        if self.last_checkpoint_watermark is not None:
            ray.get(self.learners[0].commit_buffer.remote(self.last_checkpoint_watermark))
        self.last_checkpoint_watermark = watermark
        log.info("checkpoint written: %s", paths[0])
        return paths[0]

    def close(self) -> None:
        import ray

        if self.failed:  # a role died: the others may be blocked on it; end them now
            self.supervisor.kill_all()
            if self.started_ray:
                ray.shutdown()
            return
        if self.rollout is not None:
            _quietly(lambda: ray.get(self.rollout.stop.remote(), timeout=60), "rollout stop")
        for w in self.learners:
            _quietly(lambda w=w: ray.get(w.close.remote(), timeout=30), "learner close")
        if self.buffer is not None:
            _quietly(lambda: ray.get(self.buffer.stop.remote(), timeout=30), "buffer stop")
        if self.started_ray:
            ray.shutdown()


def _quietly(fn: Any, what: str) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - shutdown continues with the other roles
        log.warning("%s failed during shutdown: %r", what, err)


def run(cfg: RunConfig, *, address: str | None = None) -> dict[str, Any]:
    """Run training end to end; returns a summary (run_dir, metrics_path, wall_s, samples, scores)."""
    import ray

    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    prepare(cfg)
    tracker = Tracker(cfg.logging, run_dir, cfg.trainer.total_steps, to_dict(cfg))
    run_ = Run(cfg, address)
    wall0 = time.monotonic()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "metrics_path": str(tracker.metrics_path)}
    stop_requested = False

    def on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        run_.start()
        summary["resumed_from"] = run_.resumed_from
        tr = cfg.trainer
        val_scores: list[tuple[int, float]] = []
        if tr.test_freq > 0 and run_.resumed_from is None:
            val = run_.guarded(lambda: ray.get(run_.rollout.validate.remote()), "validation")
            tracker.log(run_.step, {**val, "policy_version": run_.version})
            if "val/score/mean" in val:
                val_scores.append((run_.step, val["val/score/mean"]))
                summary["initial_val_score"] = val["val/score/mean"]
        bad_steps = BadStepGuard(tr.max_bad_steps)
        samples = 0
        waited_total = 0.0
        loop_start = time.monotonic()
        guarded = run_.guarded  # a dead buffer is restarted and the call retried; other deaths stop
        while run_.step < tr.total_steps:
            t_step = time.monotonic()
            waited = guarded(run_.fetch_batch, "fetching a batch")
            waited_total += waited
            step_refs = [w.step.remote(run_.version) for w in run_.learners]
            step_metrics = guarded(lambda refs=step_refs: gather(refs, "a learner step")[0], "a learner step")  # fmt: skip
            run_.step += 1
            m: dict[str, Any] = dict(step_metrics)
            bad_steps.observe(run_.step, m)
            if run_.step % cfg.weight_sync.sync_every == 0:
                new_version = run_.version + 1  # fixed before the call: a retry sends the same
                m.update(guarded(lambda v=new_version: run_.publish(v), "publishing weights"))
            guarded(run_.rejoin_restarted_engines, "engine rejoin")
            if tr.test_freq > 0 and (run_.step % tr.test_freq == 0 or run_.step == tr.total_steps):
                val = guarded(lambda: ray.get(run_.rollout.validate.remote()), "validation")
                m.update(val)
                if "val/score/mean" in val:
                    val_scores.append((run_.step, val["val/score/mean"]))
            if (tr.save_freq > 0 and run_.step % tr.save_freq == 0) or run_.step == tr.total_steps:
                guarded(run_.checkpoint, "a checkpoint")
            samples += cfg.data.train_batch_size * cfg.rollout.n
            elapsed = time.monotonic() - loop_start
            m.update(guarded(lambda: ray.get(run_.rollout.metrics.remote()), "rollout metrics"))
            buffer_stats = guarded(lambda: ray.get(run_.buffer.stats.remote()), "buffer stats")
            m.update({f"buffer/{k}": float(v) for k, v in buffer_stats.items()})
            m["supervision/buffer_restarts"] = float(run_.buffer_restarts)
            m["supervision/quarantined_engines"] = float(len(run_.quarantined))
            m["buffer/size"] = m.get("buffer/size", m.get("buffer/ready_groups", 0.0))
            m["buffer/refused_stale"] = m.get("buffer/refused_stale", 0.0)
            step_s = time.monotonic() - t_step
            m.update(
                {
                    "policy_version": run_.version,
                    "timing_s/step": step_s,
                    "timing_s/gen": waited,
                    "trainer/idle_fraction": waited_total / elapsed if elapsed > 0 else 0.0,
                    "perf/throughput": m.get("perf/tokens", 0.0) / step_s if step_s > 0 else 0.0,
                    "perf/samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
                }
            )
            tracker.log(run_.step, m)
        summary.update(samples=samples, train_wall_s=time.monotonic() - loop_start)
        if val_scores:
            summary["final_val_score"] = val_scores[-1][1]
            summary["val_scores"] = val_scores
    except KeyboardInterrupt:
        stop_requested = True
        log.warning("interrupted: writing a checkpoint and stopping")
        if run_.learners and run_.rollout is not None and not run_.failed:
            _quietly(run_.checkpoint, "checkpoint on interrupt")
    finally:
        signal.signal(signal.SIGTERM, previous)
        run_.close()
        tracker.close()
    summary["wall_s"] = time.monotonic() - wall0
    summary["interrupted"] = stop_requested
    if tracker.metrics_path.stat().st_size:
        summary["plot"] = str(
            write_score_plot(
                tracker.metrics_path, run_dir / "score_curve.png", title=f"fleetrl: {run_dir.name}"
            )
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, args.overrides)
    try:
        summary = run(cfg, address=args.address)
    except TrainingStopped as err:
        log.error("training stopped: %s", err)
        return 1
    print("\n".join(summary_lines(summary)))  # the CLI's result, on stdout
    return 0
