"""Accuracy suite: does asynchronous training learn as well as synchronous, and sooner?

The question a verl user asks before trusting an async trainer: at staleness
bound η, with the decoupled PPO correction, is the held-out score as good as the
synchronous trainer's (η = 0), and how much sooner is a given score reached?

Workload (shared with the e2e suite, ``bench.e2e.prepare_workload``): the
``synth/add2`` task (a number below 100 plus a digit: 1,000 instances, 200 of
them held out and never trained on, so the held-out score moves in steps of
0.005 and is not saturated within a few steps), a tiny model warm-started on
80 % wrong labels, and long-tailed response lengths (``bench.e2e_workload``).

Grid: η ∈ {0, 2, 4, 8} with the decoupled correction, plus the bypass loss at
η = 8, each with ``SEEDS`` trainer seeds (``--quick``: η ∈ {0, 4, 8} and the
bypass at 8, one seed).
Every run is ``launcher.train.run`` on the same data, model, resources and
concurrency cap; only η, the correction and the seed change. Runs go
seed-major, alternating the order of settings, so machine noise spreads.

Per run: the held-out score (greedy) against the step and against training
wall time (the run's elapsed clock from its first learner step). Scores come
from policy snapshots (``trainer.save_hf_freq`` = the sizes' ``test_freq``, plus
step 0) scored after the run by ``fleetrl eval`` (launcher/evaluate.py, the
run's own validation code), so the runs validate nothing: in-run validation
blocks the learner while the fleet keeps generating, and subtracting its time
hid a synchronous run's whole next batch (measured: at η = 0 with validation
every 2 steps, every step after a validation waited 0.004 s for its batch,
against 0.14-0.26 s otherwise). A snapshot costs the same at every η and stays
on the clock. Also per run: the first time and step at which the score
reaches ``target_score``, a constant of the sizes declared before any run.
Per setting: final score mean ± std over seeds, time to target mean ± std.

Summary: ``time_to_target_vs_sync`` = mean time to target at η = 0 ÷ at η = 4
(> 1: async reaches the score sooner); ``final_gap_eta4`` = mean final score
at η = 4 (decoupled) − at η = 0; ``correction_gain_eta8`` = decoupled − bypass
at η = 8. A setting where some seed never reaches the target reports its mean
over the seeds that did and ``reached`` counts them. ``sync_generation_share`` is
the fraction of η = 0's steps spent waiting for generation (its trainer idle
fraction) and ``overlap_speedup_bound`` = 1 / (1 − share): the most that running
generation beside training can save when the learner keeps its speed, so a
``time_to_target_vs_sync`` below 2 on a learner-bound workload is read against it.

Run: ``fleetrl bench accuracy --out runs/bench`` (``--quick`` for the small grid).
Left out: runs two at a time (the machine is shared; each run uses both cores).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import Progress, ratio, write_suite
from bench.e2e import (
    STEP_TIME_KEYS,
    E2ESizes,
    TrainFn,
    analyse_run,
    apply_size_flags,
    default_train_fn,
    first_number,
    prepare_workload,
    train_once,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

SUITE = "accuracy"
ETAS: tuple[int, ...] = (0, 2, 4, 8)
QUICK_ETAS: tuple[int, ...] = (0, 4, 8)  # --quick: the settings the summary needs
BYPASS_ETA = 8
SEEDS: tuple[int, ...] = (0, 1, 2)
ELAPSED_KEY = "time/elapsed_s"
ScoreFn = Callable[[Path], dict[int, float]]
STEP_KEY = "step"


@dataclasses.dataclass(frozen=True)
class AccuracySizes:
    """The workload (as the e2e suite's) plus what the accuracy grid adds."""

    workload: E2ESizes
    target_score: float  # declared before any run: the score whose arrival is timed
    seeds: tuple[int, ...] = SEEDS
    learning_rate: float | None = None  # learner.optim.lr (None: the base config's)


FULL_SIZES = AccuracySizes(
    workload=E2ESizes(
        total_steps=80,
        warmup_steps=4,
        test_freq=4,  # a policy snapshot every 4 steps (scored after the run)
        train_batch_size=8,
        group_size=8,
        max_new_tokens=48,
        budget_median=4.0,
        budget_sigma=1.1,
        train_size=2000,
        val_size=200,
        hidden=64,
        layers=2,
        engines=1,
        learner_ranks=1,
        device="cpu",
        warmstart_steps=500,
        task="add2",
    ),
    # lr 1e-4, not the demo's 3e-4: at 3e-4 the tiny model moves so far per step
    # (proximal-to-behaviour KL 0.015 per token at η = 4) that 40 steps end mid-climb and
    # the final gap measures η = 4's early lag (grid D in the README); at 1e-4 the runs
    # reach their plateau within 80 steps
    learning_rate=1e-4,
    # declared before the grid from two η = 0 runs of these sizes (0.185 at step 0,
    # 0.55-0.565 at 8, 0.73-0.74 at 24, 0.8 at 32 and 56, 0.82-0.84 at 80): the score
    # sync reaches in the middle of its run
    target_score=0.75,
)
# --quick: the same runs (a shorter warm start or run never reached the target in a
# trial: 300 warm-start steps start at 0.12 held-out), fewer settings, one seed
QUICK_SIZES = dataclasses.replace(FULL_SIZES, seeds=(0,))


def score_curve(rows: list[dict[str, Any]], scores: dict[int, float]) -> list[dict[str, float]]:
    """[{step, wall_s, score}] at each scored snapshot, by step.

    ``scores`` maps a snapshot's step to its held-out score (step 0: the policy
    before any update, at wall 0). wall_s is training wall time: the run's
    elapsed clock since its first learner step began (start-up of Ray and the
    engines excluded); the run validates nothing, so nothing is subtracted.
    """
    timed = [r for r in rows if first_number(r, STEP_TIME_KEYS) is not None]
    start = (
        (first_number(timed[0], (ELAPSED_KEY,)) or 0.0)
        - (first_number(timed[0], STEP_TIME_KEYS) or 0.0)
        if timed
        else 0.0
    )
    elapsed_at = {
        int(step): elapsed
        for r in timed
        if (step := first_number(r, (STEP_KEY,))) is not None
        and (elapsed := first_number(r, (ELAPSED_KEY,))) is not None
    }
    curve = []
    for step in sorted(scores):
        if step != 0 and step not in elapsed_at:
            raise ValueError(f"accuracy: a snapshot of step {step} but no metrics row for it")
        wall = 0.0 if step == 0 else max(0.0, elapsed_at[step] - start)
        curve.append({"step": float(step), "wall_s": wall, "score": scores[step]})
    return curve


def snapshot_scores(run_dir: str | Path) -> dict[int, float]:
    """Held-out score of every policy snapshot of a finished run, by step (``fleetrl eval``)."""
    from launcher.config import load_run_config
    from launcher.evaluate import evaluate
    from learner.snapshot import snapshot_root, snapshot_steps

    run_dir = Path(run_dir)
    found = snapshot_steps(snapshot_root(run_dir))
    if not found:
        raise ValueError(f"accuracy: run {run_dir} wrote no policy snapshots")
    cfg = load_run_config(run_dir / "config.yaml", [])
    records = evaluate(cfg, [path for _, path in found])
    return {step: float(r["val/score/mean"]) for (step, _), r in zip(found, records, strict=True)}


def first_reaching(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first validation point whose score is >= ``target`` (None if never)."""
    return next((point for point in curve if point["score"] >= target), None)


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def setting_key(eta: int, correction: str) -> str:
    return f"eta{eta}" if correction == "decoupled" else f"eta{eta}_{correction}"


def summarise(runs: list[dict[str, Any]], target: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary with the three headline figures, per-setting statistics over seeds)."""
    settings: dict[str, dict[str, Any]] = {}
    for run in runs:
        key = setting_key(run["eta"], run["correction"])
        settings.setdefault(key, {"eta": run["eta"], "correction": run["correction"], "runs": []})
        settings[key]["runs"].append(run)
    per_setting: dict[str, Any] = {}
    for key, setting in settings.items():
        mine = setting["runs"]
        finals = [r["final_score"] for r in mine if r["final_score"] is not None]
        times = [r["time_to_target_s"] for r in mine if r["time_to_target_s"] is not None]
        steps = [r["step_to_target"] for r in mine if r["step_to_target"] is not None]
        rates = [r["samples_per_s"] for r in mine if r.get("samples_per_s") is not None]
        idle = [
            r["trainer_idle_fraction"] for r in mine if r.get("trainer_idle_fraction") is not None
        ]
        final_mean, final_std = mean_std(finals)
        time_mean, time_std = mean_std(times)
        per_setting[key] = {
            "eta": setting["eta"],
            "correction": setting["correction"],
            "seeds": len(mine),
            "final_score_mean": final_mean,
            "final_score_std": final_std,
            "time_to_target_s_mean": time_mean,
            "time_to_target_s_std": time_std,
            "step_to_target_mean": mean_std(steps)[0],
            "reached": len(times),
            "samples_per_s_mean": mean_std(rates)[0],
            "trainer_idle_fraction_mean": mean_std(idle)[0],
        }

    def figure(key: str, name: str) -> float | None:
        return per_setting.get(key, {}).get(name)

    def gap(left: str, right: str) -> float | None:
        a, b = figure(left, "final_score_mean"), figure(right, "final_score_mean")
        return a - b if a is not None and b is not None else None

    summary: dict[str, Any] = {
        "time_to_target_vs_sync": ratio(
            figure("eta0", "time_to_target_s_mean"), figure("eta4", "time_to_target_s_mean")
        ),
        "final_gap_eta4": gap("eta4", "eta0"),
        "correction_gain_eta8": gap(f"eta{BYPASS_ETA}", f"eta{BYPASS_ETA}_bypass"),
        "target_score": target,
        # The share of a synchronous step spent waiting for generation bounds what overlap
        # can buy: (G + T) / T = 1 / (1 - share), when async training runs at full speed.
        "sync_generation_share": figure("eta0", "trainer_idle_fraction_mean"),
        "overlap_speedup_bound": (
            1.0 / (1.0 - share)
            if (share := figure("eta0", "trainer_idle_fraction_mean")) is not None and share < 1
            else None
        ),
    }
    for key, figures in per_setting.items():
        summary[f"final_score_mean_{key}"] = figures["final_score_mean"]
        summary[f"final_score_std_{key}"] = figures["final_score_std"]
        summary[f"time_to_target_s_{key}"] = figures["time_to_target_s_mean"]
        summary[f"reached_{key}"] = figures["reached"]
    return summary, per_setting


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    *,
    etas: Sequence[int] | None = None,
    bypass_eta: int | None = BYPASS_ETA,
    base_config: str | Path | None = None,
    train_fn: TrainFn | None = None,
    sizes: AccuracySizes | None = None,
    score_fn: ScoreFn | None = None,
    hidden: int | Sequence[int] | None = None,
    layers: int | None = None,
    engines: int | None = None,
    learner_ranks: int | None = None,
    batch: int | None = None,
    max_new_tokens: int | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Train the grid (settings × seeds), write ``accuracy.json``; ``reps`` = number of seeds.

    The size flags (``fleetrl bench accuracy --device cuda --engines 4 ...``) change the
    workload as in the e2e suite; ``target_score`` stays the one declared for the default
    sizes, so with other sizes read the final scores first.

    ``score_fn(run_dir)`` gives a finished run's held-out score per snapshot step
    (default ``snapshot_scores``: its policy snapshots scored by ``fleetrl eval``).
    """
    etas = tuple(etas) if etas is not None else (QUICK_ETAS if quick else ETAS)
    if 0 not in etas:
        raise ValueError(f"accuracy: etas must include 0 (the sync baseline), got {list(etas)}")
    started = time.monotonic()
    sizes = _grid_sizes(
        sizes or (QUICK_SIZES if quick else FULL_SIZES),
        None if quick else reps,
        hidden=hidden,
        layers=layers,
        engines=engines,
        learner_ranks=learner_ranks,
        batch=batch,
        max_new_tokens=max_new_tokens,
        device=device,
    )
    work_sizes = sizes.workload
    train = train_fn or default_train_fn()
    score = score_fn or snapshot_scores
    plan = [(eta, "decoupled") for eta in etas]
    if bypass_eta is not None:
        plan.append((bypass_eta, "bypass"))
    progress = Progress(SUITE, total=len(plan) * len(sizes.seeds))
    work = Path(out_dir) / SUITE
    workload = prepare_workload(work, work_sizes, base_config, progress)
    max_eta = max(eta for eta, _ in plan)
    runs: list[dict[str, Any]] = []
    for index, seed in enumerate(sizes.seeds):
        for eta, correction in plan if index % 2 == 0 else list(reversed(plan)):
            label = f"η={eta}" + (" bypass" if correction == "bypass" else "") + f" seed {seed}"
            run_dir = work / "runs" / f"{setting_key(eta, correction)}-seed{seed}"
            overrides = workload.overrides(
                work_sizes, eta=eta, correction=correction, run_dir=run_dir, max_eta=max_eta
            ) + _grid_overrides(sizes, seed)
            progress.note(f"training {label} -> {run_dir}")
            result, rows = train_once(train, workload.base_config, overrides, run_dir)
            record = _run_record(
                label,
                eta,
                correction,
                seed,
                str(result.get("run_dir", run_dir)),
                rows,
                score,
                sizes,
            )
            runs.append(record)
            _write_record(out_dir, runs, sizes, etas, bypass_eta, workload, started, complete=False)
            progress.step(
                f"{label}: final {record['final_score']}, target {sizes.target_score} at "
                f"{record['time_to_target_s']} s / step {record['step_to_target']}, "
                f"{record['samples_per_s']} samples/s"
            )
    return _write_record(out_dir, runs, sizes, etas, bypass_eta, workload, started, complete=True)


def _grid_sizes(sizes: AccuracySizes, seeds: int | None, **size_flags: Any) -> AccuracySizes:
    """The grid's sizes: ``seeds`` seeds when given, the workload changed by the size flags."""
    if seeds is not None:
        sizes = dataclasses.replace(sizes, seeds=tuple(range(max(1, seeds))))
    return dataclasses.replace(sizes, workload=apply_size_flags(sizes.workload, **size_flags))


def _grid_overrides(sizes: AccuracySizes, seed: int) -> list[str]:
    """What every run of the grid adds to the workload's overrides: seed, admission, snapshots."""
    overrides = [
        f"trainer.seed={seed}",
        # every group as early as η allows: the grid measures the correction at
        # staleness η, not the adaptive lead's lower staleness (buffer/lead.py)
        "buffer.admission_lead=bound",
        # no in-run validation: snapshots, scored after the run (see the docstring)
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.save_hf_freq={sizes.workload.test_freq}",
    ]
    if sizes.learning_rate is not None:
        overrides.append(f"learner.optim.lr={sizes.learning_rate}")
    return overrides


def _run_record(
    label: str,
    eta: int,
    correction: str,
    seed: int,
    run_dir: str,
    rows: list[dict[str, Any]],
    score: ScoreFn,
    sizes: AccuracySizes,
) -> dict[str, Any]:
    """One finished run's entry in ``accuracy.json``: its score curve and throughput figures."""
    curve = score_curve(rows, score(Path(run_dir)))
    reached = first_reaching(curve, sizes.target_score)
    figures = analyse_run(
        rows,
        samples_per_step=sizes.workload.train_batch_size * sizes.workload.group_size,
        warmup_steps=sizes.workload.warmup_steps,
    )
    return {
        "label": label,
        "eta": eta,
        "correction": correction,
        "seed": seed,
        "run_dir": run_dir,
        "curve": curve,
        "initial_score": curve[0]["score"] if curve else None,
        "final_score": curve[-1]["score"] if curve else None,
        "time_to_target_s": reached["wall_s"] if reached else None,
        "step_to_target": reached["step"] if reached else None,
        "samples_per_s": figures["samples_per_s"],
        "staleness_max": figures["staleness_max"],
        "trainer_idle_fraction": figures["trainer_idle_fraction"],
        "response_length_mean": figures["response_length_mean"],
        "train_wall_s": curve[-1]["wall_s"] if curve else None,
    }


def _write_record(
    out_dir: str | Path,
    runs: list[dict[str, Any]],
    sizes: AccuracySizes,
    etas: Sequence[int],
    bypass_eta: int | None,
    workload: Any,
    started: float,
    *,
    complete: bool,
) -> dict[str, Any]:
    """Write ``accuracy.json`` for the runs so far (after each run: a stopped grid keeps them)."""
    summary, per_setting = summarise(runs, sizes.target_score)
    summary["grid_complete"] = complete
    config = {
        "etas": list(etas),
        "bypass_eta": bypass_eta,
        "seeds": list(sizes.seeds),
        "target_score": sizes.target_score,
        "base_config": str(workload.base_config),
        "sizes": dataclasses.asdict(sizes.workload),
    }
    results = {"runs": runs, "settings": per_setting, "long_tail": workload.budget}
    return write_suite(
        out_dir, SUITE, config=config, results=results, summary=summary, started=started
    )
