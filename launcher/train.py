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
         └── this loop: wait for a batch, step, publish, snapshot, validate, checkpoint, log

Who waits for whom: the learner waits for B whole groups (``trainer/idle_fraction``);
the fleet waits for admission, which opens B more groups per published version
(``rollout/idle_fraction``); a full buffer blocks the fleet's sends. With
``buffer.max_staleness = 0`` admission lets exactly one version's batch be in
flight, which is synchronous on-policy training, by the same code.

The loop (``train_loop``) is one role call per line, each carrying its data;
the roles (``launcher.session.Run``) return typed results (launcher/results.py)
and are called through ``launcher.supervision.Supervised``, which restarts a dead
buffer and retries the call, or stops the run when another role died. The loop
names no transport and no fault: it runs unchanged on fake roles in the unit
tests (tests/unit/launcher/test_controller.py).

Before anything starts, ``launcher.preflight`` checks every precondition and lists
every unmet one (exit 2). Stopping: SIGINT (Ctrl-C) or SIGTERM finishes the step in
progress, writes a checkpoint and exits 0; a second Ctrl-C forces the stop. During
start-up a signal ends every role started so far at once and exits 128 + the
signal's number with one line. ``trainer.resume=auto`` continues from there.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetrl.config import to_dict
from fleetrl.log import get_logger
from launcher.config import RunConfig
from launcher.early_ray import EarlyRay, starts_local_instance
from launcher.placement import ask_for_token_auth
from launcher.preflight import ensure_ready, load_for_run
from launcher.preflight_findings import PreflightFailed
from launcher.prepare import prepare
from launcher.report import summary_lines, write_score_plot
from launcher.results import StartRecord
from launcher.run_folder import finished_line, read_folder, write_config
from launcher.sample_account import sample_account
from launcher.session import Run
from launcher.step_calls import RewardsFailing, StopRequested
from launcher.supervision import BadStepGuard, TrainingStopped
from launcher.tracking import Tracker

log = get_logger(__name__)

__all__ = ["Run", "TrainingStopped", "execute", "main", "run", "train_loop"]


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


@dataclass
class Progress:
    """The schedule's clock: steps taken, the version trained against, what was consumed."""

    step: int = 0
    version: int = 0
    samples: int = 0
    waited_s: float = 0.0  # time the learner waited for batches (trainer/idle_fraction)
    checkpointed_step: int = -1
    last_metrics: dict[str, Any] = field(default_factory=dict)  # the last step's, as logged
    val_scores: list[tuple[int, float]] = field(default_factory=list)
    # the rule score of the held-out samples, apart from the reward (a run that learns from
    # a reward model: did the policy move toward what the rule says?)
    val_rule_scores: list[tuple[int, float]] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    loop_started_at: float = 0.0

    @classmethod
    def resuming(cls, origin: StartRecord, started_at: float) -> Progress:
        done = origin.step if origin.resumed_from is not None else -1
        return cls(
            origin.step, origin.policy_version, checkpointed_step=done, started_at=started_at
        )


def due(step: int, every: int, last: int) -> bool:
    """Every ``every`` steps (``every`` <= 0: never) and at the last step."""
    return every > 0 and (step % every == 0 or step == last)


def run_gpus(cfg: RunConfig) -> float:
    """GPUs the run reserves: learner ranks, rollout engines and reward servers."""
    rm = cfg.reward.model
    reward = rm.num_engines * rm.gpus_per_engine if cfg.reward.uses_model and not rm.urls else 0.0
    return (
        cfg.learner.num_ranks * cfg.learner.gpus_per_rank
        + cfg.rollout.num_engines * cfg.rollout.gpus_per_engine
        + reward
    )


def saves_at(step: int, save_freq: int, last: int) -> bool:
    """``trainer.save_freq``: every ``save_freq`` steps and at the last (-1: the last only; 0: never)."""
    return save_freq != 0 and (due(step, save_freq, last) or step == last)


def train_loop(roles: Any, cfg: RunConfig, progress: Progress, tracker: Any, stop: Any) -> None:
    """The schedule: wait for a batch, step, publish, snapshot, validate, checkpoint, log; repeat
    (a step listed in ``trainer.profile_steps`` is recorded by every learner rank and engine).

        ``roles``: the role calls (``Run.supervised()``, or fakes); ``stop.check()`` raises
        ``StopRequested`` between steps and while waiting.
    """
    tr, bad_steps = cfg.trainer, BadStepGuard(cfg.trainer.max_bad_steps)
    devices = run_gpus(cfg) or 1.0
    progress.loop_started_at = time.monotonic()
    while progress.step < tr.total_steps:
        stop.check()
        t_step = time.monotonic()
        profiled = progress.step + 1 in tr.profile_steps
        if profiled:  # the whole step: the wait, the update, the publish, validation, saving
            roles.start_profile(progress.step + 1)
        waited = roles.wait_for_batch(progress.version, stop.check)
        publishes = (progress.step + 1) % cfg.weight_sync.sync_every == 0
        snapshot = due(progress.step + 1, tr.save_hf_freq, tr.total_steps)
        # queued with the step: its publish, its snapshot and (but after the last step) the
        # next batch's fetch, so the learner waits for the driver between none of them
        result = roles.step(
            progress.version,
            publish=publishes,
            snapshot_step=progress.step + 1 if snapshot else None,
            fetch_next=progress.step + 1 < tr.total_steps,
        )
        progress.step += 1
        progress.samples += cfg.data.train_batch_size * cfg.rollout.n
        bad_steps.observe(progress.step, result.skipped_nonfinite)
        m: dict[str, Any] = dict(result.metrics)
        if publishes:
            published = roles.publish(progress.version + 1)  # a retry sends the same version
            progress.version = published.version
            m.update(published.metrics)
        roles.rejoin_engines()
        if snapshot:
            roles.save_hf_snapshot(progress.step)
        if due(progress.step, tr.test_freq, tr.total_steps):
            m.update(validate(roles, progress, tracker))
        if saves_at(progress.step, tr.save_freq, tr.total_steps):
            t_save = time.monotonic()
            roles.checkpoint(progress.step)
            progress.checkpointed_step = progress.step
            m["timing_s/save_checkpoint"] = time.monotonic() - t_save
        if profiled:
            roles.stop_profile(progress.step)
        m.update(roles.role_metrics())
        m.update(roles.supervision_metrics())
        progress.last_metrics = m
        tracker.log(progress.step, m | clock_metrics(progress, m, waited, t_step, devices))


def validate(roles: Any, progress: Progress, tracker: Any) -> dict[str, float]:
    """Validation metrics (verl's ``timing_s/testing`` with them); its samples to the tracker."""
    t0 = time.monotonic()
    result = roles.validate()
    metrics = dict(result.metrics)
    metrics["timing_s/testing"] = time.monotonic() - t0
    if "val/score/mean" in metrics:
        progress.val_scores.append((progress.step, metrics["val/score/mean"]))
    if "val/rule_score/mean" in metrics:
        progress.val_rule_scores.append((progress.step, metrics["val/rule_score/mean"]))
    tracker.log_generations(progress.step, progress.version, result.samples)
    return metrics


def clock_metrics(
    progress: Progress, m: dict[str, Any], waited: float, t_step: float, devices: float = 1.0
) -> dict[str, float]:
    """Timing and throughput of this step (``m`` gives the step's token count); ``devices``:
    the GPUs of the run (1 on a CPU), verl's divisor of ``perf/throughput``."""
    progress.waited_s += waited
    now = time.monotonic()
    elapsed, step_s = now - progress.loop_started_at, now - t_step
    tokens = m.get("perf/total_num_tokens", 0.0)
    out = {
        "policy_version": progress.version,
        "training/global_step": progress.step,
        "timing_s/step": step_s,
        "timing_s/gen": waited,  # time this step waited for generated data
        "time/elapsed_s": now - progress.started_at,
        "trainer/idle_fraction": progress.waited_s / elapsed if elapsed > 0 else 0.0,
        # verl's: tokens of the batch per second and per device of the run
        "perf/time_per_step": step_s,
        "perf/throughput": tokens / (step_s * devices) if step_s > 0 else 0.0,
        "perf/samples_per_s": progress.samples / elapsed if elapsed > 0 else 0.0,
    }
    # verl's timing_per_token_ms: generation per response token, the rest per token
    per_token = {"gen": (waited, m.get("perf/response_tokens", 0.0))}
    for stage in ("ref", "values", "adv", "update_critic", "update_actor"):
        if f"timing_s/{stage}" in m:
            per_token[stage] = (m[f"timing_s/{stage}"], tokens)
    for stage, (seconds, count) in per_token.items():
        if count > 0:
            out[f"timing_per_token_ms/{stage}"] = seconds * 1000 / count
    return out


def execute(
    session: Any, cfg: RunConfig, tracker: Any, stop: Any, after_training: Any = None
) -> dict[str, Any]:
    """Start the roles, run the loop, stop cleanly; the summary of what happened.

    A stop request checkpoints (unless the last step was just saved); so does a reward
    that fails on everything (``RewardsFailing``), which then raises ``TrainingStopped``
    with its reason; a dead role (``TrainingStopped``) propagates after every role is ended.
    ``after_training()`` runs once the loop finishes, before the roles are ended (the
    end-of-run plot starts there, so that it is drawn while they shut down).
    """
    wall0 = time.monotonic()
    roles = session.supervised()
    progress = Progress(started_at=wall0)
    summary: dict[str, Any] = {}
    interrupted_start: StartupInterrupted | None = None
    failing: RewardsFailing | None = None
    try:
        stop.install()
        origin = session.start(after_ray_init=stop.install)
        stop.starting = False
        progress = Progress.resuming(origin, wall0)
        summary["resumed_from"] = origin.resumed_from
        if cfg.trainer.val_before_train and cfg.data.val_files and origin.resumed_from is None:
            val = validate(roles, progress, tracker)
            tracker.log(progress.step, {**val, "policy_version": progress.version})
            if "val/score/mean" in val:
                summary["initial_val_score"] = val["val/score/mean"]
            if cfg.reward.uses_model and "val/rule_score/mean" in val:
                summary["initial_val_rule_score"] = val["val/rule_score/mean"]
        if cfg.trainer.save_hf_freq > 0 and origin.resumed_from is None:
            roles.save_hf_snapshot(progress.step)  # the policy before any update
        train_loop(roles, cfg, progress, tracker, stop)
        summary["train_wall_s"] = time.monotonic() - progress.loop_started_at
        if after_training is not None:
            after_training()
    except (StopRequested, KeyboardInterrupt) as err:
        stop.starting = False
        summary["interrupted"] = str(err) or stop.received or "SIGINT"
        if isinstance(err, RewardsFailing):
            failing = err  # said once, by the caller, after the checkpoint below
        if not session.started:
            interrupted_start = StartupInterrupted(summary["interrupted"], session.phase)
        else:
            if failing is None:
                log.warning("stopping at step %d on %s", progress.step, summary["interrupted"])
            if cfg.trainer.save_freq == 0:
                log.warning("trainer.save_freq=0: no checkpoint written, this run cannot resume")
            elif not roles.failed and progress.step != progress.checkpointed_step:
                session.checkpoint(progress.step)
    finally:
        stop.restore()
        session.close(failed=roles.failed)
        summary["samples"] = progress.samples
        summary.update(measured_scores(progress, rule=cfg.reward.uses_model))
        if progress.last_metrics:
            account = sample_account(cfg.trainer.output_dir, progress.last_metrics, cfg.rollout.n)
            summary["sample_account"] = account
    if interrupted_start is not None:
        raise interrupted_start
    if failing is not None:
        raise TrainingStopped(f"{failing}; fix the reward, then {session.resume_hint()}")
    summary["wall_s"] = time.monotonic() - wall0
    return summary


def measured_scores(progress: Progress, *, rule: bool) -> dict[str, Any]:
    """The held-out scores validation measured after a step (one at step 0 is the "before"
    score, never an "after"): the last one and its step, and every point."""
    out: dict[str, Any] = {}
    if progress.val_scores:
        out["val_scores"] = progress.val_scores
    after = [(step, score) for step, score in progress.val_scores if step > 0]
    if after:
        out["final_val_step"], out["final_val_score"] = after[-1]
    after_rule = [(step, score) for step, score in progress.val_rule_scores if step > 0]
    if rule and after_rule:
        out["final_val_rule_score"] = after_rule[-1][1]
    return out


def run(
    cfg: RunConfig,
    *,
    address: str | None = None,
    config_errors: list[str] | None = None,
    resume_with_changes: bool = False,
) -> dict[str, Any]:
    """Run training end to end; returns a summary (run_dir, metrics_path, wall_s, samples, scores).

    Every precondition is checked first (``launcher.preflight``): nothing is built or
    started when one is unmet, and ``PreflightFailed`` lists them all, after
    ``config_errors`` (the config's rule errors). ``resume_with_changes``: continue the run
    in ``trainer.output_dir`` although its config differs (``launcher.run_folder``).
    """
    ask_for_token_auth(address or cfg.ray.address)  # before anything imports Ray
    stop = StopSignal()
    stop.install()  # from here on a stop is clean: see StopSignal
    # a local instance starts beside the slow checks, once the quick ones passed
    early_ray = EarlyRay(cfg) if starts_local_instance(cfg, address) else None
    try:
        ensure_ready(
            cfg,
            address,
            config_errors=config_errors,
            resume_with_changes=resume_with_changes,
            after_quick_checks=early_ray.begin if early_ray else None,
        )
        if early_ray:
            early_ray.keep_driver_threads()
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = prepare(cfg)
        write_config(run_dir, cfg)
        tracker = Tracker(cfg.logging, run_dir, cfg.trainer.total_steps, to_dict(cfg))
        session = Run(cfg, address, early_ray=early_ray)
    except (StopRequested, KeyboardInterrupt):
        stop.restore()
        if early_ray:
            early_ray.end()
        raise StartupInterrupted(stop.received or "SIGINT", "preparing the run") from None
    except BaseException:
        stop.restore()
        if early_ray:
            early_ray.end()
        raise
    summary: dict[str, Any] = {"run_dir": str(run_dir), "metrics_path": str(tracker.metrics_path)}
    plot = ScorePlot(tracker.metrics_path, run_dir / "score_curve.png", f"fleetrl: {run_dir.name}")
    try:
        summary.update(execute(session, cfg, tracker, stop, after_training=plot.start))
    finally:
        tracker.close()
    if tracker.metrics_path.stat().st_size:
        summary["plot"] = str(plot.finish())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class ScorePlot:
    """The end-of-run score curve, drawn in a thread while the roles shut down (importing
    matplotlib and drawing take about a second, Ray's shutdown as long, mostly waiting), or
    at the end when the run stopped before its loop finished."""

    def __init__(self, metrics_path: Path, out_png: Path, title: str) -> None:
        self.args = (metrics_path, out_png, title)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._draw, name="score-plot", daemon=True)
        self._thread.start()

    def _draw(self) -> None:
        try:
            write_score_plot(*self.args)
        except BaseException as err:  # noqa: BLE001 - handed to finish(), in the main thread
            self._error = err

    def finish(self) -> Path:
        """The PNG's path, drawn by now (here, if ``start`` never ran)."""
        if self._thread is None:
            self._draw()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.args[1]


def main(args: argparse.Namespace) -> int:
    cfg, name, config_errors = load_for_run(args.config, args.overrides)
    done = None if config_errors else finished_line(cfg, read_folder(cfg))
    if done is not None:  # nothing to train: said before Ray would start
        print(f"fleetrl train: {done}")  # the CLI's result, on stdout
        return 0
    try:
        summary = run(
            cfg,
            address=args.address,
            config_errors=config_errors,
            resume_with_changes=args.resume_with_changes,
        )
    except PreflightFailed as err:
        raise err.named(name) from None
    except TrainingStopped as err:
        log.error("training stopped: %s", err)
        return 1
    except StartupInterrupted as err:
        print(f"fleetrl: {err}", file=sys.stderr)  # the CLI's result: one line
        return err.exit_code
    print("\n".join(summary_lines(summary)))  # the CLI's result, on stdout
    return 0
