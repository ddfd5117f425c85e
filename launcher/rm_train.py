"""`fleetrl rm train`: Bradley-Terry reward-model training on the FSDP2 learner group.

Data flow::

    preference Parquet ──► rank 0: PreferencePairs (tokenized once) + PairCursor (epochs)
                                │ every step: data.train_batch_size pairs as Arrow IPC bytes
                                ▼ broadcast over the learner group (no batch crosses Ray)
                 RewardTrainerRole × learner.num_ranks (FSDP2; Ray-placed on learner nodes)
                    each rank: its pairs, chosen + rejected in one forward, scores at each
                    sequence's EOS, -log σ(r_c - r_r - m), guarded optimizer step
                                │
    this loop: step ─► held-out scores (trainer.test_freq) ─► checkpoint + reward_model/
               (trainer.save_freq, and at the end) ─► metrics.jsonl / wandb / TensorBoard

Why Ray, as ``fleetrl train``: the ranks are placed the way the RL learner group is
(``launcher.placement``: one placement group on nodes with the learner resource, bounded
and explained waiting), so a reward model trains on the same cluster configs, across
nodes, with nothing else to set up; a local run starts its own Ray instance.

The run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_<N>``
(``trainer.resume=auto`` continues from the latest complete one, data cursor included),
``reward_model/`` (``learner.reward_export``: what transformers loads and SGLang serves,
the held-out score statistics in its config.json) and ``summary.json``.

Before anything starts the base model and data must exist, or be buildable:
``rm.policy_config`` prepares the RL run whose model this is (``launcher.prepare``);
``data.synth_task`` writes the demo's preference set. Ctrl-C or SIGTERM finishes the step,
writes a checkpoint and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from fleetrl.config import ConfigError, to_dict
from fleetrl.data.preference import read_preference_rows
from fleetrl.log import get_logger
from launcher.rm_config import RmRunConfig, load_rm_config, placement_config
from launcher.rm_roles import DataSummary, RmStepResult
from launcher.step_calls import StopRequested
from launcher.supervision import BadStepGuard, TrainingStopped, gather
from launcher.tracking import Tracker
from launcher.train import StartupInterrupted, StopSignal, due

log = get_logger(__name__)

CLOSE_TIMEOUT_S = 30.0


def prepare_rm(cfg: RmRunConfig) -> None:
    """Build what the config names but the disk lacks (the base model, the demo's data);
    check every preference file's rows (``DatasetError``: one line naming file and row)."""
    from launcher.config import RunConfig, load_run_config
    from launcher.prepare import ensure_model, prepare

    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        if cfg.rm.policy_config:
            policy = load_run_config(cfg.rm.policy_config, training=True)
            if Path(policy.model.path).resolve() != model_dir.resolve():
                raise ConfigError(
                    "rm.policy_config",
                    f"{cfg.rm.policy_config} builds model.path={policy.model.path}, this run reads {model_dir}",  # fmt: skip
                )
            prepare(policy)  # its data and its warm-started model, as `fleetrl train` would
        elif cfg.model.create_tiny:
            ensure_model(RunConfig(model=cfg.model))
        else:
            raise ConfigError(
                "model.path",
                f"{model_dir} is not a Hugging Face model folder (set rm.policy_config to build the RL run's model, or model.create_tiny)",  # fmt: skip
            )
    data = cfg.data
    missing = [f for f in data.train_files + data.val_files if not Path(f).is_file()]
    if missing:
        generate_missing_data(cfg, missing)
    for file in data.train_files + data.val_files:  # bad rows: one line now, not in a rank
        read_preference_rows(file)


def generate_missing_data(cfg: RmRunConfig, missing: list[str]) -> None:
    data = cfg.data
    if not data.synth_task:
        raise ConfigError("data.train_files", f"file not found: {missing[0]} (set data.synth_task to generate the demo's preference set)")  # fmt: skip
    from fleetrl.data.synth_preference import write_preference_set

    train, test = write_preference_set(
        data.synth_task, Path(data.train_files[0]).parent, data.synth_train_size,
        data.synth_test_size, data.seed,
    )  # fmt: skip
    if train != Path(data.train_files[0]):
        train.replace(data.train_files[0])
    if data.val_files and test != Path(data.val_files[0]):
        test.replace(data.val_files[0])


@dataclass
class RewardGroup:
    """The reward-model learner group on Ray: placed, set up, resumed, stepped, closed."""

    cfg: RmRunConfig
    address: str | None = None

    def __post_init__(self) -> None:
        self.raw = to_dict(self.cfg)
        self.actors: list[Any] = []
        self.placement_group: Any = None
        self.started_ray = False
        self.ckpt_root = Path(self.cfg.trainer.output_dir) / "checkpoints"

    def start(self, after_ray_init: Any = None) -> tuple[int, str | None, DataSummary]:
        """Place and set up every rank, resume when asked; (step, resumed_from, data)."""
        import ray

        from launcher.config import resolve_device
        from launcher.placement import (
            bundle_options,
            init_ray,
            learner_placement_group,
            wait_for_learner_group,
        )
        from launcher.rm_roles import RewardTrainerRole
        from launcher.roles import remote_class
        from learner.checkpoint import latest_complete_checkpoint

        view = placement_config(self.cfg)
        # known before ray.init returns, so that close() ends a half-started local instance
        self.started_ray = not (self.address or self.cfg.ray.address or os.environ.get("RAY_ADDRESS"))  # fmt: skip
        self.started_ray = init_ray(view, self.address)
        if after_ray_init is not None:
            after_ray_init()
        pg = self.placement_group = learner_placement_group(view)
        wait_for_learner_group(pg, view)
        world = self.cfg.learner.num_ranks
        role = remote_class(RewardTrainerRole)
        self.actors = [
            role.options(**bundle_options(pg, r, view)).remote(self.raw, r, world, self.started_ray)
            for r in range(world)
        ]
        master = ray.get(self.actors[0].master_address.remote())
        data = self._call("setup", master, resolve_device(view))[0]
        step, resumed_from = 0, None
        latest = latest_complete_checkpoint(self.ckpt_root) if self.cfg.trainer.resume == "auto" else None  # fmt: skip
        if latest is not None:
            step = self._call("load_checkpoint", str(latest))[0]
            resumed_from = str(latest)
            log.info("resumed from %s (step %d)", latest, step)
        return step, resumed_from, data

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Every rank runs ``method`` (a collective); a user error inside one is raised as
        itself (one line at the CLI), any other failure as TrainingStopped."""
        import ray

        try:
            return gather([getattr(a, method).remote(*args) for a in self.actors], f"rm {method}")
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError | FileNotFoundError):
                raise err.cause from None  # bad data, checkpoint or config found by a rank
            raise TrainingStopped(f"reward-model {method} failed: {err.cause!r}") from None
        except ray.exceptions.RayError as err:
            raise TrainingStopped(f"a reward-model rank died during {method}: {err}") from None

    def step(self) -> RmStepResult:
        return self._call("step")[0]

    def evaluate(self) -> Any:
        return self._call("evaluate")[0]

    def checkpoint(self) -> str:
        return self._call("save_checkpoint", str(self.ckpt_root))[0]

    def export(self, stats: Any) -> str:
        from learner.reward_export import REWARD_MODEL_DIR

        return self._call("export", str(Path(self.cfg.trainer.output_dir) / REWARD_MODEL_DIR), stats)[0]  # fmt: skip

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        from launcher.placement import shutdown_local_ray

        if not ray.is_initialized():
            return
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=CLOSE_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.warning("reward-model ranks did not close cleanly: %s", err)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        if self.started_ray:
            shutdown_local_ray()


def train_rm_loop(group: Any, cfg: RmRunConfig, step: int, tracker: Any, stop: Any) -> Any:
    """Step, evaluate, checkpoint and export until trainer.total_steps; the last PairScores."""
    tr, guard = cfg.trainer, BadStepGuard(cfg.trainer.max_bad_steps)
    held_out = None
    while step < tr.total_steps:
        stop.check()
        tick = time.monotonic()
        result = group.step()
        step += 1
        guard.observe(step, result.skipped_nonfinite)
        metrics = dict(result.metrics)
        held_out = None
        if due(step, tr.test_freq, tr.total_steps):
            held_out = group.evaluate()
            metrics.update(held_out.metrics("val/"))
        if due(step, tr.save_freq, tr.total_steps) or step == tr.total_steps:
            group.checkpoint()
            if held_out is None:
                held_out = group.evaluate()
                metrics.update(held_out.metrics("val/"))
            group.export(held_out.stats())
        metrics["timing_s/iteration"] = time.monotonic() - tick
        tracker.log(step, metrics)
    return held_out


def run_rm(cfg: RmRunConfig, *, address: str | None = None) -> dict[str, Any]:
    """Train a reward model end to end; the run's summary (also written to summary.json)."""
    stop = StopSignal()
    stop.install()
    run_dir = Path(cfg.trainer.output_dir)
    group, tracker = None, None
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        prepare_rm(cfg)
        tracker = Tracker(cfg.logging, run_dir, cfg.trainer.total_steps, to_dict(cfg))
        group = RewardGroup(cfg, address)
        wall0 = time.monotonic()
        step, resumed_from, data = group.start(after_ray_init=stop.install)
        stop.starting = False
        summary.update(resumed_from=resumed_from, data=msgspec.to_builtins(data))
        for line in data.lines():
            log.info("%s", line)
        if cfg.trainer.test_freq > 0 and resumed_from is None:
            initial = group.evaluate()
            tracker.log(0, initial.metrics("val/"))
            summary["initial_val"] = msgspec.to_builtins(initial)
        final = train_rm_loop(group, cfg, step, tracker, stop)
        if final is not None:
            summary["final_val"] = msgspec.to_builtins(final)
            from learner.reward_export import REWARD_MODEL_DIR

            summary["reward_model"] = str(run_dir / REWARD_MODEL_DIR)
        summary["wall_s"] = time.monotonic() - wall0
    except (StopRequested, KeyboardInterrupt) as err:
        if stop.starting or group is None or not group.actors:
            raise StartupInterrupted(stop.received or "SIGINT", "starting the reward-model group") from None  # fmt: skip
        summary["interrupted"] = str(err) or stop.received or "SIGINT"
        log.warning("stopping on %s: writing a checkpoint", summary["interrupted"])
        summary["checkpoint"] = group.checkpoint()
    finally:
        stop.restore()
        if group is not None:
            group.close()
        if tracker is not None:
            tracker.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [f"run dir: {summary['run_dir']}"]
    if summary.get("data"):
        lines += DataSummary(**summary["data"]).lines()
    for key, label in (("initial_val", "held-out before"), ("final_val", "held-out after")):
        if summary.get(key):
            v = summary[key]
            lines.append(
                f"{label}: accuracy {v['accuracy']:.3f}, chosen {v['chosen_mean']:+.3f}, "
                f"rejected {v['rejected_mean']:+.3f} ({v['pairs']} pairs)"
            )
    if summary.get("reward_model"):
        lines.append(f"reward model: {summary['reward_model']}")
    if summary.get("interrupted"):
        lines.append(f"stopped by {summary['interrupted']}; checkpoint {summary['checkpoint']}")
    return lines


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl rm train``."""
    from launcher.placement import ask_for_token_auth

    cfg = load_rm_config(args.config, args.overrides)
    ask_for_token_auth(args.address or cfg.ray.address)  # before anything imports Ray
    try:
        summary = run_rm(cfg, address=args.address)
    except TrainingStopped as err:
        log.error("reward-model training stopped: %s", err)
        return 1
    except StartupInterrupted as err:
        print(f"fleetrl: {err}", file=sys.stderr)
        return err.exit_code
    print("\n".join(summary_lines(summary)))  # the CLI's result, on stdout
    return 0
