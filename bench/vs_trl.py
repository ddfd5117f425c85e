"""vs-trl suite: fleetrl against TRL's GRPOTrainer, the trainer a user would pick instead.

``fleetrl bench vs-trl --out DIR [--quick] [--reps N] [--regime demo|generation-bound|both]``

Per regime (``bench.vs_trl_regimes``: the overhead-bound demo and a
generation-bound workload) and seed, three commands run from start to exit, each
in a fresh process, their order alternated from seed to seed so a neighbour's
load hits every arm alike:

- ``fleetrl``: ``fleetrl train`` at the regime's η (the demo's own, 2);
- ``fleetrl-sync``: the same at η = 0 (on-policy, as TRL is: sample efficiency);
- ``trl``: ``python -m bench.trl_grpo`` on the same config (``bench.trl_grpo``).

Every run gets the same model, data, hyperparameters and seed
(``trainer.seed`` and ``data.seed``), validates nothing in-run and writes a
policy snapshot every ``snapshot_every`` steps (fleetrl: ``trainer.save_hf_freq``;
TRL: a callback calling the same ``learner.snapshot.write_hf_snapshot``), on its
training clock. After the runs, one evaluator (``bench.held_out``: greedy, the
held-out set, the task's rule) scores each run's snapshots in step order until
one reaches the regime's target, and its last.

Per run: the whole command's seconds (process start to exit), the training
clock at each snapshot (from the first step's start: generation of the first
batch included, start-up excluded), time and samples to the target, samples/s
while training (all samples ÷ the training clock), the final score, the load
average around it. Summary per regime (``demo_*``, ``generation_bound_*``),
medians over seeds:

- ``time_to_target_speedup``: TRL's time to the target ÷ fleetrl's (fleetrl ÷
  TRL in speed: > 1, fleetrl gets there sooner);
- ``samples_per_s_ratio``: fleetrl's samples/s ÷ TRL's;
- ``command_time_ratio``: fleetrl's whole command ÷ TRL's (< 1: shorter), and
  ``command_speedup``, its inverse;
- ``samples_to_target_ratio`` and ``samples_to_target_ratio_sync``: samples
  fleetrl needed to reach the target ÷ TRL's, at the regime's η and at η = 0, and
  ``sample_efficiency_sync``, the inverse of the latter.

The report's headline ratios are the ones where > 1 means fleetrl is ahead
(speedups, samples/s, sample efficiency); the others are its fleetrl ÷ TRL figures.

A run that never reaches the target has no time to it and counts, in the median
over seeds, as later than every run that did: a median that falls on such a run
(most seeds never got there) is None, and so is the ratio built on it. TRL missing: the suite
stops at once with the one line that installs it (``pip install ".[bench]"`` in fleetrl's checkout).
Left out: TRL's asynchronous trainer, which needs vLLM and NCCL (``bench.trl_grpo``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.accuracy import first_reaching, score_curve
from bench.common import (
    REPO_ROOT,
    Progress,
    end_process_group,
    ratio,
    write_suite,
)
from bench.e2e import read_metrics
from bench.trl_grpo import ASYNC_TRAINER_NOTE, trl_available
from bench.vs_trl_regimes import REGIMES, Prepared, Regime, prepare, regime
from fleetrl.bytecode import compile_packages
from fleetrl.log import get_logger

log = get_logger(__name__)

SUITE = "vs-trl"
SEEDS = (0, 1, 2)
QUICK_SEEDS = {"demo": (0, 1, 2), "generation-bound": (0,)}
ARMS = ("fleetrl", "trl", "fleetrl-sync")
RUN_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    eta: int | None  # fleetrl's staleness bound (None: TRL)


def arms_for(reg: Regime) -> list[Arm]:
    return [Arm("fleetrl", reg.fleetrl_eta), Arm("trl", None), Arm("fleetrl-sync", 0)]


def command_for(arm: Arm, prepared: Prepared, run_dir: Path, seed: int) -> list[str]:
    """The command line of one run: ``fleetrl train`` or the TRL runner, same config."""
    reg = prepared.regime
    overrides = [
        *prepared.overrides,
        f"trainer.output_dir={run_dir}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.save_hf_freq={reg.snapshot_every}",
        "logging.wandb=false",
    ]
    if arm.eta is None:
        return [sys.executable, "-m", "bench.trl_grpo", "--config", str(prepared.base_config),
                "--out", str(run_dir), *overrides]  # fmt: skip
    overrides += [
        "trainer.save_freq=0",
        "trainer.resume=disable",
        f"buffer.max_staleness={arm.eta}",
        f"buffer.bank_dir={run_dir / 'rollout_bank'}",
    ]
    return [sys.executable, "-m", "launcher.cli", "train", "--config",
            str(prepared.base_config), *overrides]  # fmt: skip


def run_command(cmd: list[str], run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` from the repository root; its wall seconds, exit status, the load around it."""
    import shutil

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    load = os.getloadavg()[0]
    started = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_process_group(proc)
            code = None
        except KeyboardInterrupt:  # the run's whole process group goes with the suite
            end_process_group(proc)
            raise
    return {
        "command_s": time.monotonic() - started,
        "returncode": code,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def evaluate_run(
    run_dir: Path, evaluator: Any, initial: float, target: float, samples_per_step: int
) -> dict[str, Any]:
    """Scores of a finished run's snapshots (in step order up to the target, and the last)
    on its training clock; time, step and samples to the target."""
    from learner.snapshot import snapshot_root, snapshot_steps

    rows = read_metrics(run_dir / "metrics.jsonl")
    found = snapshot_steps(snapshot_root(run_dir))
    if not found:
        raise RuntimeError(f"vs-trl: {run_dir} wrote no policy snapshots (see {run_dir}.log)")
    scores = {0: initial}
    for step, folder in found:
        if step == 0:
            continue
        scores[step] = evaluator.score(folder)
        if scores[step] >= target:
            break
    last_step, last_folder = found[-1]
    if last_step not in scores:
        scores[last_step] = evaluator.score(last_folder)
    curve = score_curve(rows, scores)
    reached = first_reaching(curve, target)
    train_wall = curve[-1]["wall_s"] if curve else None
    steps = len([r for r in rows if "timing_s/step" in r])
    return {
        "curve": curve,
        "final_score": scores[last_step],
        "time_to_target_s": reached["wall_s"] if reached else None,
        "step_to_target": reached["step"] if reached else None,
        "samples_to_target": reached["step"] * samples_per_step if reached else None,
        "train_wall_s": train_wall,
        "samples_per_s": ratio(steps * samples_per_step, train_wall),
        "steps": steps,
    }


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_to_target(values: Sequence[float | None]) -> float | None:
    """Median of a time (or sample count) to the target where None is a run that never got
    there: later than every run that did, so a median that falls on one is None."""
    if not values:
        return None
    middle = statistics.median_low if len(values) % 2 else statistics.median
    reached = sorted(math.inf if v is None else float(v) for v in values)
    value = middle(reached)
    return None if math.isinf(value) else value


TO_TARGET = ("time_to_target_s", "samples_to_target")  # None: the run never reached it


def summarise(runs: list[dict[str, Any]], regimes: Sequence[Regime]) -> dict[str, Any]:
    """Per regime, medians over seeds of each arm's figures and the fleetrl ÷ TRL ratios."""
    summary: dict[str, Any] = {}
    for reg in regimes:
        prefix = reg.name.replace("-", "_")
        mine = [r for r in runs if r["regime"] == reg.name]

        def med(arm: str, key: str, mine=mine) -> float | None:
            values = [r.get(key) for r in mine if r["arm"] == arm]
            return _median_to_target(values) if key in TO_TARGET else _median(values)

        for arm in ARMS:
            for key in ("time_to_target_s", "samples_to_target", "samples_per_s", "command_s",
                        "final_score"):  # fmt: skip
                summary[f"{prefix}_{arm.replace('-', '_')}_{key}"] = med(arm, key)
            summary[f"{prefix}_{arm.replace('-', '_')}_reached"] = sum(
                1 for r in mine if r["arm"] == arm and r.get("time_to_target_s") is not None
            )
        summary[f"{prefix}_target_score"] = reg.target_score
        summary[f"{prefix}_time_to_target_speedup"] = ratio(
            med("trl", "time_to_target_s"), med("fleetrl", "time_to_target_s")
        )
        summary[f"{prefix}_time_to_target_speedup_sync"] = ratio(
            med("trl", "time_to_target_s"), med("fleetrl-sync", "time_to_target_s")
        )
        summary[f"{prefix}_samples_per_s_ratio"] = ratio(
            med("fleetrl", "samples_per_s"), med("trl", "samples_per_s")
        )
        summary[f"{prefix}_command_time_ratio"] = ratio(
            med("fleetrl", "command_s"), med("trl", "command_s")
        )
        summary[f"{prefix}_command_speedup"] = ratio(
            med("trl", "command_s"), med("fleetrl", "command_s")
        )
        summary[f"{prefix}_samples_to_target_ratio"] = ratio(
            med("fleetrl", "samples_to_target"), med("trl", "samples_to_target")
        )
        summary[f"{prefix}_samples_to_target_ratio_sync"] = ratio(
            med("fleetrl-sync", "samples_to_target"), med("trl", "samples_to_target")
        )
        summary[f"{prefix}_sample_efficiency_sync"] = ratio(
            med("trl", "samples_to_target"), med("fleetrl-sync", "samples_to_target")
        )
        summary[f"{prefix}_seeds"] = len({r["seed"] for r in mine})
        summary[f"{prefix}_load_median"] = _median([r.get("load_before") for r in mine])
    return summary


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    *,
    regime_name: str = "both",
    hidden: int | Sequence[int] | None = None,
    layers: int | None = None,
    engines: int | None = None,
    batch: int | None = None,
    max_new_tokens: int | None = None,
    device: str | None = None,
    headline_eta: int | None = None,
    arms: Sequence[str] = ARMS,
    regimes: Sequence[Regime] | None = None,
) -> dict[str, Any]:
    """Run every regime's arms × seeds, alternated; write ``vs-trl.json``.

    ``reps``: seeds per regime (default 3; ``--quick``: 3 at the demo size, 1 at the
    generation-bound size). ``headline_eta``: the fleetrl arm's η (default: the regime's).
    ``arms``: which of ``ARMS`` run; ``regimes``: these instead of the named ones (tests).
    """
    missing = trl_available()
    if missing:
        print(missing, file=sys.stderr)
        return {"status": "error", "error": missing, "summary": {}}
    compile_packages()  # as pip compiled TRL's: no arm compiles its own modules per run
    started = time.monotonic()
    names = REGIMES if regime_name == "both" else (regime_name,)
    flags = {"hidden": hidden, "layers": layers, "engines": engines, "batch": batch,
             "max_new_tokens": max_new_tokens, "device": device}  # fmt: skip
    if regimes is None:
        regimes = [regime(name, **flags) for name in names]
    if headline_eta is not None:
        regimes = [dataclasses.replace(r, fleetrl_eta=headline_eta) for r in regimes]
    work = Path(out_dir) / SUITE
    runs: list[dict[str, Any]] = []
    for reg in regimes:
        seeds = tuple(range(reps)) if reps else (QUICK_SEEDS[reg.name] if quick else SEEDS)
        runs += _run_regime(reg, seeds, arms, work, out_dir, regimes, runs, started)
    return _write(out_dir, runs, regimes, started, complete=True)


def _run_regime(
    reg: Regime,
    seeds: Sequence[int],
    arm_names: Sequence[str],
    work: Path,
    out_dir: str | Path,
    regimes: Sequence[Regime],
    done: list[dict[str, Any]],
    started: float,
) -> list[dict[str, Any]]:
    from bench.held_out import HeldOutEvaluator

    arms = [arm for arm in arms_for(reg) if arm.name in arm_names]
    progress = Progress(SUITE, total=len(seeds) * len(arms))
    progress.note(f"{reg.name}: preparing the model and data (once per folder)")
    prepared = prepare(reg, work)
    evaluator = HeldOutEvaluator([prepared.val_file], prepared.model_dir, reg.eval_max_new_tokens)
    initial = evaluator.score(prepared.model_dir)
    samples_per_step = _samples_per_step(prepared)
    runs: list[dict[str, Any]] = []
    for index, seed in enumerate(seeds):
        for arm in arms if index % 2 == 0 else list(reversed(arms)):
            run_dir = work / reg.name / "runs" / f"{arm.name}-seed{seed}"
            cmd = command_for(arm, prepared, run_dir, seed)
            progress.note(f"{reg.name} {arm.name} seed {seed} -> {run_dir}")
            record: dict[str, Any] = {"regime": reg.name, "arm": arm.name, "eta": arm.eta,
                                      "seed": seed, "run_dir": str(run_dir)}  # fmt: skip
            record.update(run_command(cmd, run_dir, RUN_TIMEOUT_S))
            if record["returncode"] != 0:
                raise RuntimeError(
                    f"vs-trl: {arm.name} seed {seed} exited {record['returncode']}; "
                    f"see {run_dir}.log"
                )
            record.update(
                evaluate_run(run_dir, evaluator, initial, reg.target_score, samples_per_step)
            )
            record["initial_score"] = initial
            runs.append(record)
            _write(out_dir, done + runs, regimes, started, complete=False)
            progress.step(
                f"{arm.name}: command {record['command_s']:.1f}s, target at "
                f"{_fmt(record['time_to_target_s'])}s / {record['samples_to_target']} samples, "
                f"{_fmt(record['samples_per_s'])} samples/s, final {record['final_score']:.3f}"
            )
    return runs


def _samples_per_step(prepared: Prepared) -> int:
    from launcher.config import load_run_config

    cfg = load_run_config(prepared.base_config, list(prepared.overrides))
    return cfg.data.train_batch_size * cfg.rollout.n


def _fmt(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


def _write(
    out_dir: str | Path,
    runs: list[dict[str, Any]],
    regimes: Sequence[Regime],
    started: float,
    *,
    complete: bool,
) -> dict[str, Any]:
    summary = summarise(runs, regimes)
    summary["complete"] = complete
    config = {
        "regimes": [dataclasses.asdict(r) for r in regimes],
        "arms": list(ARMS),
        "trl": "GRPOTrainer (trl 1.16.0); " + ASYNC_TRAINER_NOTE,
    }
    results = {"runs": runs}
    return write_suite(
        out_dir, SUITE, config=config, results=results, summary=summary, started=started
    )
