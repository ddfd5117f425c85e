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

Before anything starts, ``launcher.preflight`` checks every precondition and lists
every unmet one (exit 2). Stopping: SIGINT (Ctrl-C) or SIGTERM finishes the step in
progress, writes a checkpoint and exits 0; a second Ctrl-C forces the stop. During
start-up a signal ends every role started so far at once and exits 128 + the
signal's number with one line. ``trainer.resume=auto``
continues from there. The roles and their supervision live in ``launcher.session``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from fleetrl.config import to_dict
from fleetrl.log import get_logger
from launcher.config import RunConfig, load_run_config
from launcher.preflight import ensure_ready
from launcher.prepare import prepare
from launcher.report import summary_lines, write_score_plot
from launcher.session import Run, StopRequested
from launcher.supervision import BadStepGuard, TrainingStopped, gather
from launcher.tracking import Tracker

log = get_logger(__name__)

__all__ = ["Run", "TrainingStopped", "main", "run"]


class StartupInterrupted(Exception):
    """A stop signal arrived before training began; every role started so far was ended."""

    def __init__(self, signal_name: str, phase: str):
        self.signal_name = signal_name
        super().__init__(
            f"stopped by {signal_name} while {phase}; every role started so far has been ended"
        )

    @property
    def exit_code(self) -> int:
        return 128 + int(signal.Signals[self.signal_name])


class StopSignal:
    """SIGINT/SIGTERM set a flag the loop checks between steps; a second SIGINT forces.

    While ``starting`` (until every role serves) a signal raises ``KeyboardInterrupt`` at
    once: start-up blocks in long waits (placement, engine start) that checking a flag would
    not end, and Ray's blocking calls let only ``KeyboardInterrupt`` through a signal handler
    (anything else surfaces as a SystemError). ``received`` names the signal.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self.starting = True
        self._previous: dict[int, Any] = {}

    def install(self) -> None:  # again after ray.init, which installs a SIGTERM handler
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)  # restore() brings back the first

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = name
        if self.starting:
            self.starting = False  # once: the clean-up that follows is not interrupted again
            log.warning("%s during start-up: ending every role started so far", name)
            raise KeyboardInterrupt(name)
        log.warning(
            "%s: finishing this step, writing a checkpoint, then stopping (Ctrl-C again to force)",
            name,
        )

    def check(self) -> None:
        if self.received is not None:
            raise StopRequested(self.received)


def validate(run_: Run) -> tuple[dict[str, float], float]:
    import ray

    t0 = time.monotonic()
    metrics = run_.guarded(lambda: ray.get(run_.rollout.validate.remote()), "validation")
    return metrics, time.monotonic() - t0


def role_metrics(run_: Run) -> dict[str, float]:
    """What the rollout side and the buffer report after a step (for metrics.jsonl)."""
    import ray

    m = dict(run_.guarded(lambda: ray.get(run_.rollout.metrics.remote()), "rollout metrics"))
    stats = run_.guarded(lambda: ray.get(run_.buffer.stats.remote()), "buffer stats")
    m.update({f"buffer/{k}": float(v) for k, v in stats.items()})
    m["buffer/size"] = m.get("buffer/size", m.get("buffer/ready_groups", 0.0))
    m["buffer/refused_stale"] = m.get("buffer/refused_stale", 0.0)
    m["supervision/buffer_restarts"] = float(run_.buffer_restarts)
    m["supervision/quarantined_engines"] = float(len(run_.quarantined))
    return m


def run(cfg: RunConfig, *, address: str | None = None) -> dict[str, Any]:
    """Run training end to end; returns a summary (run_dir, metrics_path, wall_s, samples, scores).

    Every precondition is checked first (``launcher.preflight``): nothing is built or
    started when one is unmet, and ``PreflightFailed`` lists them all.
    """
    stop = StopSignal()
    stop.install()  # from here on a stop is clean: see StopSignal
    try:
        ensure_ready(cfg, address)
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        prepare(cfg)
        tracker = Tracker(cfg.logging, run_dir, cfg.trainer.total_steps, to_dict(cfg))
        run_, tr = Run(cfg, address), cfg.trainer
    except (StopRequested, KeyboardInterrupt):
        stop.restore()
        raise StartupInterrupted(stop.received or "SIGINT", "preparing the run") from None
    except BaseException:
        stop.restore()
        raise
    interrupted_start: StartupInterrupted | None = None
    wall0 = time.monotonic()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "metrics_path": str(tracker.metrics_path)}
    val_scores: list[tuple[int, float]] = []
    samples, waited_total, checkpointed_step = 0, 0.0, -1
    try:
        run_.start(after_ray_init=stop.install)
        stop.starting = False
        summary["resumed_from"] = run_.resumed_from
        if run_.resumed_from is not None:
            checkpointed_step = run_.step  # a stop right away must not rewrite that checkpoint
        if tr.test_freq > 0 and run_.resumed_from is None:
            val, val_s = validate(run_)
            tracker.log(
                run_.step, {**val, "policy_version": run_.version, "timing_s/validate": val_s}
            )
            if "val/score/mean" in val:
                val_scores.append((run_.step, val["val/score/mean"]))
                summary["initial_val_score"] = val["val/score/mean"]
        bad_steps = BadStepGuard(tr.max_bad_steps)
        guarded = run_.guarded  # a dead buffer is restarted and the call retried; other deaths stop
        loop_start = time.monotonic()
        while run_.step < tr.total_steps:
            stop.check()
            t_step = time.monotonic()
            waited = guarded(lambda: run_.fetch_batch(stop.check), "fetching a batch")
            waited_total += waited
            refs = [w.step.remote(run_.version) for w in run_.learners]
            m: dict[str, Any] = dict(guarded(lambda refs=refs: gather(refs, "a learner step")[0], "a learner step"))  # fmt: skip
            run_.step += 1
            samples += cfg.data.train_batch_size * cfg.rollout.n
            bad_steps.observe(run_.step, m)
            if run_.step % cfg.weight_sync.sync_every == 0:
                new_version = run_.version + 1  # fixed before the call: a retry sends the same
                m.update(guarded(lambda v=new_version: run_.publish(v), "publishing weights"))
            guarded(run_.rejoin_restarted_engines, "engine rejoin")
            if tr.test_freq > 0 and (run_.step % tr.test_freq == 0 or run_.step == tr.total_steps):
                val, m["timing_s/validate"] = validate(run_)
                m.update(val)
                if "val/score/mean" in val:
                    val_scores.append((run_.step, val["val/score/mean"]))
            if (tr.save_freq > 0 and run_.step % tr.save_freq == 0) or run_.step == tr.total_steps:
                guarded(run_.checkpoint, "a checkpoint")
                checkpointed_step = run_.step
            m.update(role_metrics(run_))
            elapsed, step_s = time.monotonic() - loop_start, time.monotonic() - t_step
            m.update({
                "policy_version": run_.version,
                "timing_s/step": step_s,
                "timing_s/gen": waited,  # time this step waited for generated data
                "time/elapsed_s": time.monotonic() - wall0,
                "trainer/idle_fraction": waited_total / elapsed if elapsed > 0 else 0.0,
                "perf/throughput": m.get("perf/tokens", 0.0) / step_s if step_s > 0 else 0.0,
                "perf/samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
            })  # fmt: skip
            tracker.log(run_.step, m)
        summary.update(samples=samples, train_wall_s=time.monotonic() - loop_start)
    except (StopRequested, KeyboardInterrupt) as err:
        stop.starting = False
        summary.update(interrupted=str(err) or stop.received or "SIGINT", samples=samples)
        if not run_.started:
            interrupted_start = StartupInterrupted(summary["interrupted"], run_.phase)
        else:
            log.warning("stopping at step %d on %s", run_.step, summary["interrupted"])
            if not run_.failed and run_.step != checkpointed_step:
                run_.checkpoint()
    finally:
        stop.restore()
        run_.close()
        tracker.close()
    if interrupted_start is not None:
        raise interrupted_start
    if val_scores:
        summary["final_val_score"] = val_scores[-1][1]
        summary["val_scores"] = val_scores
    summary["wall_s"] = time.monotonic() - wall0
    if tracker.metrics_path.stat().st_size:
        plot = write_score_plot(
            tracker.metrics_path, run_dir / "score_curve.png", title=f"fleetrl: {run_dir.name}"
        )
        summary["plot"] = str(plot)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, args.overrides)
    try:
        summary = run(cfg, address=args.address)
    except TrainingStopped as err:
        log.error("training stopped: %s", err)
        return 1
    except StartupInterrupted as err:
        print(f"fleetrl: {err}", file=sys.stderr)  # the CLI's result: one line
        return err.exit_code
    print("\n".join(summary_lines(summary)))  # the CLI's result, on stdout
    return 0
