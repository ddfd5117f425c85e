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
from launcher.tracking import Tracker

log = get_logger(__name__)

STALL_WARN_S = 60.0  # warn when the learner has waited this long for one batch


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite losses, a dead role) with a clear reason."""


class Run:
    """The roles of one run, created by ``start`` and ended by ``close`` (in that order)."""

    def __init__(self, cfg: RunConfig, address: str | None):
        self.cfg = cfg
        self.address = address
        self.run_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.raw = to_dict(cfg)
        self.started_ray = False
        self.buffer: Any = None
        self.learners: list[Any] = []
        self.rollout: Any = None
        self.step = 0
        self.version = 0
        self.resumed_from: str | None = None

    # ---- set-up ---------------------------------------------------------------------------
    def start(self) -> None:
        import ray

        from launcher.placement import bundle_options, init_ray, learner_placement_group
        from launcher.roles import BufferRole, LearnerRole, RolloutRole, remote_class

        cfg = self.cfg
        self.started_ray = init_ray(cfg, self.address)
        local = self.started_ray
        bank_dir = cfg.buffer.bank_dir or str(self.run_dir / "rollout_bank")
        self.buffer = remote_class(BufferRole, num_cpus=0).remote(self.raw, bank_dir, local)
        ingest, control = ray.get(self.buffer.start.remote())

        pg = learner_placement_group(cfg)
        ray.get(pg.ready())
        learner_cls = remote_class(LearnerRole)
        world = cfg.learner.num_ranks
        self.learners = [
            learner_cls.options(**bundle_options(pg, r, cfg)).remote(self.raw, r, world, local)
            for r in range(world)
        ]
        master = ray.get(self.learners[0].master_address.remote())
        ray.get([w.setup.remote(master, control) for w in self.learners])

        from learner.checkpoint import latest_complete_checkpoint

        extra: dict[str, Any] = {}
        latest = (
            latest_complete_checkpoint(self.ckpt_root) if cfg.trainer.resume == "auto" else None
        )
        if latest is not None:
            extra = ray.get([w.load_checkpoint.remote(str(latest)) for w in self.learners])[0]
            state = ray.get(self.learners[0].state.remote())
            self.step, self.version = state["step"], state["policy_version"]
            self.resumed_from = str(latest)
            reset = ray.get(
                self.learners[0].resume_buffer.remote(
                    self.version, int(extra.get("buffer", {}).get("received_watermark", 0))
                )
            )
            log.info(
                "resumed from %s: step %d, policy version %d, admission counter reset to %d groups",
                latest,
                self.step,
                self.version,
                reset,
            )

        self.rollout = remote_class(RolloutRole, num_cpus=0, max_concurrency=16).remote(
            self.raw, ingest, control, str(self.run_dir), local
        )
        urls = ray.get(self.rollout.start_engines.remote())
        ray.get(
            self.learners[0].connect_engines.remote([(n, u, None) for n, u in sorted(urls.items())])
        )
        if extra.get("reader"):
            ray.get(self.rollout.load_reader_state.remote(extra["reader"]))
        # Engines serve only after they hold the learner's weights: after a resume these are
        # the restored ones (peers that skip this generate from stale weights or deadlock).
        sync = self.publish(self.version, restored=self.resumed_from is not None)
        if sync.get("weight_sync/num_failed"):
            raise TrainingStopped(f"initial weight sync failed: {sync}")
        ray.get(self.rollout.start_generation.remote())

    # ---- the pieces of a step ---------------------------------------------------------------
    def publish(self, version: int, restored: bool = False) -> dict[str, float]:
        import ray

        self.version = version
        out = ray.get([w.publish.remote(version, restored) for w in self.learners])[0]
        if out.get("weight_sync/needs_resend"):
            # a failure mid-stream left survivors with partial weights: send the version again
            log.warning("version %d reached some engines partially; publishing it again", version)
            out = ray.get([w.publish.remote(version, restored) for w in self.learners])[0]
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
        """Engines the fleet replaced join weight sync now and serve after the next publish."""
        import ray

        restarted = ray.get(self.rollout.pending_restarts.remote())
        for name, url in restarted.items():
            log.info(
                "engine %s restarted at %s: it receives version %d before serving",
                name,
                url,
                self.version,
            )
            ray.get(self.learners[0].add_engine.remote(name, url, None))
        if restarted:
            self.publish(self.version)
            ray.get(self.rollout.mark_ready.remote(sorted(restarted)))

    def checkpoint(self) -> str:
        import ray

        extra = {"reader": ray.get(self.rollout.reader_state.remote()), "step": self.step}
        paths = ray.get(
            [w.save_checkpoint.remote(str(self.ckpt_root), extra) for w in self.learners]
        )
        ray.get(self.learners[0].commit_buffer.remote())
        log.info("checkpoint written: %s", paths[0])
        return paths[0]

    def close(self) -> None:
        import ray

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
            val = ray.get(run_.rollout.validate.remote())
            tracker.log(run_.step, {**val, "policy_version": run_.version})
            if "val/score/mean" in val:
                val_scores.append((run_.step, val["val/score/mean"]))
                summary["initial_val_score"] = val["val/score/mean"]
        bad_steps = samples = 0
        waited_total = 0.0
        loop_start = time.monotonic()
        while run_.step < tr.total_steps:
            t_step = time.monotonic()
            waited = run_.fetch_batch()
            waited_total += waited
            step_metrics = ray.get([w.step.remote(run_.version) for w in run_.learners])[0]
            run_.step += 1
            m: dict[str, Any] = dict(step_metrics)
            if m.get("actor/skipped_nonfinite", 0) > 0:
                bad_steps += 1
                log.warning(
                    "step %d: non-finite loss or gradient, update skipped (%d in a row)",
                    run_.step,
                    bad_steps,
                )
                if bad_steps >= tr.max_bad_steps:
                    raise TrainingStopped(
                        f"{bad_steps} consecutive steps had a non-finite loss or gradient (trainer.max_bad_steps={tr.max_bad_steps}); last checkpoint stays valid"
                    )
            else:
                bad_steps = 0
            if run_.step % cfg.weight_sync.sync_every == 0:
                m.update(run_.publish(run_.version + 1))
            run_.rejoin_restarted_engines()
            if tr.test_freq > 0 and (run_.step % tr.test_freq == 0 or run_.step == tr.total_steps):
                val = ray.get(run_.rollout.validate.remote())
                m.update(val)
                if "val/score/mean" in val:
                    val_scores.append((run_.step, val["val/score/mean"]))
            if (tr.save_freq > 0 and run_.step % tr.save_freq == 0) or run_.step == tr.total_steps:
                run_.checkpoint()
            samples += cfg.data.train_batch_size * cfg.rollout.n
            elapsed = time.monotonic() - loop_start
            m.update(ray.get(run_.rollout.metrics.remote()))
            m.update(
                {f"buffer/{k}": float(v) for k, v in ray.get(run_.buffer.stats.remote()).items()}
            )
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
        if run_.learners and run_.rollout is not None:
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
