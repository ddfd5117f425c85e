"""End-to-end suite: the real training loop at staleness bound η = 1, 2, 4 against η = 0.

Every run is ``launcher.train.run`` on the same base config (``configs/demo_cpu.yaml``),
the same resources (engines, learner ranks, concurrency cap) and the same data;
only ``buffer.max_staleness`` changes, so η = 0 is the synchronous trainer (the
pattern of verl's default trainer) on exactly the code path of the async runs.
At the largest η a second run swaps the decoupled correction for the bypass
loss, so the score the correction buys is visible beside it.

Long-tailed response lengths (what makes a synchronous trainer wait on
stragglers) come from the model itself: ``bench.e2e_workload`` warm-starts the
tiny model on answers padded with a lognormal number of spaces (which the
scorer ignores), so most responses stop early and a few run to the cap. The
measured mean response length is recorded beside the target distribution.
The model is built once per output folder, before any timed run.

Figures per run, from its ``metrics.jsonl``: samples/s = trajectories trained
per second of wall time after ``warmup_steps``, the validations and the final
checkpoint in that window *included*, for every η alike (an async fleet keeps
generating while the trainer validates; a sync one cannot; both are charged the
same wall clock for the same work), the validation score curve against wall
time, trainer and rollout idle fractions, the largest staleness seen.

Fairness: the headline η is declared before anything runs (``headline_eta``,
default 2, recorded in the JSON's config); every η runs ``reps`` times (quick:
2, full: 3), the order of a repetition reversed on the next (0 1 2 4, then
4 2 1 0), so drift in a shared machine's load hits sync and async alike.
Headline: ``async_vs_sync`` = the median over repetitions of the paired ratio
samples/s(η = headline) ÷ samples/s(η = 0) of the same repetition, with its
min and max (``async_vs_sync_min`` / ``_max``) and every pair; each η gets its
own ``async_vs_sync_eta{η}``. ``best_eta`` is reported after the fact only.
The bypass-loss run (scores, not speed) runs once, in the first repetition.

Left out: any claim about final accuracy beyond the scores measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Progress, declare_suite, median, ratio, write_suite
from bench.e2e_workload import build_model, write_long_tail_data
from fleetrl.log import get_logger

log = get_logger(__name__)

SUITE = "e2e"
ETAS: tuple[int, ...] = (0, 1, 2, 4)
HEADLINE_ETA = 2  # declared before the runs; the headline ratio is at this η
QUICK_REPS, FULL_REPS = 2, 3
DEFAULT_BASE_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo_cpu.yaml"
# metrics.jsonl keys (the launcher's contract), with the alternatives accepted for each
ELAPSED_KEYS = ("time/elapsed_s", "timing_s/elapsed", "elapsed_s", "wall_s")
STEP_TIME_KEYS = ("timing_s/step",)
VALIDATION_TIME_KEYS = (
    "timing_s/testing",
    "timing_s/validate",
    "timing_s/val",
    "timing_s/validation",
)
SAMPLES_KEYS = ("batch/samples", "samples", "train/samples", "perf/samples")
SCORE_KEYS = ("val/score/mean",)
RESPONSE_LENGTH_KEYS = (
    "response_length/mean",
    "response/length_mean",
    "batch/response_length_mean",
)
TrainFn = Callable[..., dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class E2ESizes:
    """What one e2e run trains on; every run of a suite shares it."""

    total_steps: int
    warmup_steps: int
    test_freq: int
    train_batch_size: int  # prompts (groups) per learner step
    group_size: int  # rollout.n
    max_new_tokens: int  # cap of the long-tailed budgets
    budget_median: float  # median of the lognormal budget
    budget_sigma: float  # its log-space standard deviation
    train_size: int
    val_size: int
    hidden: int
    layers: int
    engines: int
    learner_ranks: int
    device: str
    warmstart_steps: int | None = None  # supervised steps of the new model (None = base config)
    task: str = "add"
    seed: int = 0


QUICK_SIZES = E2ESizes(
    total_steps=32,
    warmup_steps=4,
    test_freq=16,
    train_batch_size=4,
    group_size=4,
    max_new_tokens=48,
    budget_median=4.0,
    budget_sigma=1.1,
    train_size=400,
    val_size=20,
    hidden=64,
    layers=2,
    engines=1,
    learner_ranks=1,
    device="cpu",
    warmstart_steps=200,
)
FULL_SIZES = dataclasses.replace(
    QUICK_SIZES,
    total_steps=60,
    warmup_steps=5,
    test_freq=10,
    train_batch_size=8,
    group_size=8,
    max_new_tokens=96,
    budget_median=8.0,
    train_size=2000,
    val_size=100,
    warmstart_steps=None,
)


def apply_size_flags(
    sizes: E2ESizes,
    *,
    hidden: int | Sequence[int] | None = None,
    layers: int | None = None,
    engines: int | None = None,
    learner_ranks: int | None = None,
    batch: int | None = None,
    max_new_tokens: int | None = None,
    device: str | None = None,
) -> E2ESizes:
    """``sizes`` with the harness's size flags that are set (first hidden size only)."""
    if isinstance(hidden, Sequence):
        hidden = hidden[0] if hidden else None
    changes = {
        "hidden": hidden,
        "layers": layers,
        "engines": engines,
        "learner_ranks": learner_ranks,
        "train_batch_size": batch,
        "max_new_tokens": max_new_tokens,
        "device": device,
    }
    sizes = dataclasses.replace(sizes, **{k: v for k, v in changes.items() if v is not None})
    if sizes.max_new_tokens < 2:
        raise ValueError(f"e2e: max_new_tokens must be >= 2, got {sizes.max_new_tokens}")
    return sizes


def run_overrides(
    sizes: E2ESizes,
    *,
    eta: int,
    correction: str,
    run_dir: Path,
    model_dir: Path,
    train_file: Path,
    val_file: Path,
    max_eta: int,
) -> list[str]:
    """Dotted overrides on the base config for one run (only ``eta`` and ``correction`` vary)."""
    warmstart = (
        [] if sizes.warmstart_steps is None else [f"model.warmstart.steps={sizes.warmstart_steps}"]
    )
    return warmstart + [
        f"trainer.output_dir={run_dir}",
        f"trainer.total_steps={sizes.total_steps}",
        f"trainer.test_freq={sizes.test_freq}",
        "trainer.save_freq=-1",
        "trainer.resume=disable",
        f"trainer.device={sizes.device}",
        f"trainer.seed={sizes.seed}",
        f"model.path={model_dir}",
        "model.create_tiny=false",
        f"data.train_files=[{train_file}]",
        f"data.val_files=[{val_file}]",
        "data.synth_task=''",
        f"data.train_batch_size={sizes.train_batch_size}",
        f"rollout.n={sizes.group_size}",
        f"rollout.max_new_tokens={sizes.max_new_tokens}",
        f"rollout.num_engines={sizes.engines}",
        # the same concurrency cap for every η: what the largest bound can use
        f"rollout.max_concurrent_groups={(max_eta + 1) * sizes.train_batch_size}",
        f"learner.num_ranks={sizes.learner_ranks}",
        f"learner.correction.mode={correction}",
        f"buffer.max_staleness={eta}",
        f"buffer.bank_dir={run_dir / 'rollout_bank'}",
        "logging.wandb=false",
    ]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d is not JSON; skipped", path, number)
    return rows


def first_number(row: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    """The first of ``keys`` whose value in ``row`` is a finite number (bools are not)."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def analyse_run(
    rows: list[dict[str, Any]], *, samples_per_step: int, warmup_steps: int
) -> dict[str, Any]:
    """Throughput, score curve, idle fractions and staleness of one run's metrics rows.

    Wall time at each row is the run's own elapsed clock when it logs one, else the
    running sum of ``timing_s/step``. Training rows after the first ``warmup_steps``
    are measured: samples/s is their samples over the wall time of that window,
    validations and checkpoints in it included (the same accounting for every η;
    ``validation_s`` reports how much of the window they took). Trainer idle is the
    share of measured step time spent waiting for a batch (``timing_s/gen``);
    rollout idle is the run's cumulative figure at the last measured step.
    """
    clock, elapsed = 0.0, []
    for row in rows:
        logged = first_number(row, ELAPSED_KEYS)
        clock = logged if logged is not None else clock + (first_number(row, STEP_TIME_KEYS) or 0.0)
        elapsed.append(clock)
    train_index = [i for i, r in enumerate(rows) if first_number(r, STEP_TIME_KEYS) is not None]
    measured_index = train_index[warmup_steps:]
    measured = [rows[i] for i in measured_index]
    samples_per_s, window_s = None, None
    if measured:
        start = elapsed[train_index[warmup_steps - 1]] if warmup_steps else 0.0
        window_s = elapsed[measured_index[-1]] - start
        samples = sum(first_number(r, SAMPLES_KEYS) or samples_per_step for r in measured)
        samples_per_s = ratio(samples, window_s)
    validation_s = sum(first_number(r, VALIDATION_TIME_KEYS) or 0.0 for r in measured)
    curve = [
        [elapsed[i], first_number(row, SCORE_KEYS)]
        for i, row in enumerate(rows)
        if first_number(row, SCORE_KEYS) is not None
    ]
    scores = [s for _, s in curve]
    step_s = sum(first_number(r, STEP_TIME_KEYS) or 0.0 for r in measured)
    waited_s = sum(first_number(r, ("timing_s/gen",)) or 0.0 for r in measured)
    has_wait = any(first_number(r, ("timing_s/gen",)) is not None for r in measured)
    staleness = [s for r in rows if (s := first_number(r, ("staleness/max",))) is not None]
    lengths = [m for r in measured if (m := first_number(r, RESPONSE_LENGTH_KEYS)) is not None]
    last = measured[-1] if measured else {}
    return {
        "steps": len(train_index),
        "measured_steps": len(measured),
        "throughput_method": "window, validation included",
        "samples_per_s": samples_per_s,
        "window_s": window_s,
        "validation_s": validation_s,
        "curve": curve,
        "final_val_score": scores[-1] if scores else None,
        "best_val_score": max(scores) if scores else None,
        "trainer_idle_fraction": ratio(waited_s, step_s)
        if has_wait
        else first_number(last, ("trainer/idle_fraction",)),
        "rollout_idle_fraction": first_number(last, ("rollout/idle_fraction",)),
        "staleness_max": max(staleness, default=None),
        "response_length_mean": sum(lengths) / len(lengths) if lengths else None,
        # samples/s rewards short responses; tokens/s shows whether a policy just answers shorter
        "response_tokens_per_s": samples_per_s * sum(lengths) / len(lengths)
        if samples_per_s is not None and lengths
        else None,
        "loop_s": elapsed[-1] if elapsed else None,
    }


def paired_ratios(runs: list[dict[str, Any]], eta: int) -> list[float]:
    """samples/s at ``eta`` ÷ samples/s at η = 0, one per repetition that has both."""

    def rate(e: int, rep: int) -> float | None:
        for r in runs:
            if r["eta"] == e and r["rep"] == rep and r["correction"] == "decoupled":
                return r.get("samples_per_s")
        return None

    pairs = []
    for rep in sorted({r["rep"] for r in runs}):
        value = ratio(rate(eta, rep), rate(0, rep))
        if value is not None:
            pairs.append(value)
    return pairs


def summarise(
    runs: list[dict[str, Any]], etas: Sequence[int], headline_eta: int = HEADLINE_ETA
) -> dict[str, Any]:
    """Headline (paired, at the declared η), per-η ratios, scores and idle fractions
    (medians over repetitions)."""
    summary: dict[str, Any] = {"headline_eta": headline_eta}
    per_eta: dict[int, dict[str, float | None]] = {}
    for eta in etas:
        mine = [r for r in runs if r["eta"] == eta and r["correction"] == "decoupled"]
        per_eta[eta] = {
            key: median([r[key] for r in mine if r.get(key) is not None])
            if any(r.get(key) is not None for r in mine)
            else None
            for key in (
                "samples_per_s",
                "final_val_score",
                "trainer_idle_fraction",
                "rollout_idle_fraction",
                "response_tokens_per_s",
            )
        }
    per_eta_ratio: dict[int, float] = {}
    for eta in etas:
        if eta == 0:
            continue
        pairs = paired_ratios(runs, eta)
        summary[f"async_vs_sync_eta{eta}"] = median(pairs) if pairs else None
        summary[f"async_vs_sync_eta{eta}_min"] = min(pairs) if pairs else None
        summary[f"async_vs_sync_eta{eta}_max"] = max(pairs) if pairs else None
        summary[f"async_vs_sync_eta{eta}_pairs"] = pairs
        if pairs:
            per_eta_ratio[eta] = median(pairs)
    for suffix in ("", "_min", "_max", "_pairs"):
        summary[f"async_vs_sync{suffix}"] = summary.get(f"async_vs_sync_eta{headline_eta}{suffix}")
    summary["repetitions"] = len({r["rep"] for r in runs})
    # after the fact, for information: the headline stays at the declared η
    summary["best_eta"] = (
        max(per_eta_ratio, key=per_eta_ratio.__getitem__) if per_eta_ratio else None
    )
    for eta, figures in per_eta.items():
        summary[f"samples_per_s_eta{eta}"] = figures["samples_per_s"]
        summary[f"val_score_eta{eta}"] = figures["final_val_score"]
        summary[f"trainer_idle_eta{eta}"] = figures["trainer_idle_fraction"]
        summary[f"rollout_idle_eta{eta}"] = figures["rollout_idle_fraction"]
        summary[f"response_tokens_per_s_eta{eta}"] = figures["response_tokens_per_s"]
    bypass = [
        r for r in runs if r["correction"] == "bypass" and r.get("final_val_score") is not None
    ]
    if bypass:
        top = bypass[0]["eta"]
        summary[f"val_score_bypass_eta{top}"] = median([r["final_val_score"] for r in bypass])
        decoupled = per_eta.get(top, {}).get("final_val_score")
        bypass_score = summary[f"val_score_bypass_eta{top}"]
        summary["correction_score_gain"] = (
            decoupled - bypass_score if decoupled is not None else None
        )
    return summary


def run_plan(etas: Sequence[int], reps: int) -> list[tuple[int, int, str]]:
    """(rep, η, correction) in running order: every η each repetition, the order reversed
    on odd repetitions; the bypass run at the largest η once, in the first."""
    plan = []
    for rep in range(reps):
        order = list(etas) if rep % 2 == 0 else list(reversed(etas))
        plan += [(rep, eta, "decoupled") for eta in order]
        if rep == 0:
            plan.append((rep, max(etas), "bypass"))
    return plan


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every run of a suite shares: data files, the warm-started model, the base config."""

    train_file: Path
    val_file: Path
    budget: dict[str, Any]  # the long-tail length targets' distribution and percentiles
    model_dir: Path
    base_config: Path

    def overrides(
        self, sizes: E2ESizes, *, eta: int, correction: str, run_dir: Path, max_eta: int
    ) -> list[str]:
        """``run_overrides`` for one run on this workload's model and data."""
        return run_overrides(
            sizes, eta=eta, correction=correction, run_dir=run_dir, model_dir=self.model_dir,
            train_file=self.train_file, val_file=self.val_file, max_eta=max_eta,
        )  # fmt: skip


def prepare_workload(
    work: Path, sizes: E2ESizes, base_config: str | Path | None, progress: Progress
) -> Workload:
    """Write the long-tailed data under ``work`` and build (once) the warm-started model."""
    from launcher.config import load_run_config

    base = Path(base_config) if base_config is not None else DEFAULT_BASE_CONFIG
    train_file, val_file, budget_stats = write_long_tail_data(work / "data", sizes)
    base_cfg = load_run_config(base if base.is_file() else None, [])
    # built once, reused by every run and by later invocations on the same folder
    warm = "base" if sizes.warmstart_steps is None else sizes.warmstart_steps
    model_dir = work / (
        f"model-{sizes.task}-h{sizes.hidden}-l{sizes.layers}-w{warm}"
        f"-len{sizes.budget_median:g}x{sizes.budget_sigma:g}-cap{sizes.max_new_tokens}"
    )
    progress.note(f"building the warm-started model at {model_dir} (once per output folder)")
    build_model(model_dir, train_file, sizes, base_cfg.model.warmstart, base_cfg.model.tiny)
    return Workload(train_file, val_file, budget_stats, model_dir, base)


def train_once(
    train: TrainFn, base: Path, overrides: list[str], run_dir: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One training run from scratch in ``run_dir``: (the loop's result, its metrics rows)."""
    from launcher.config import load_run_config

    cfg = load_run_config(base if base.is_file() else None, overrides)
    if run_dir.exists():  # metrics.jsonl is appended to: start every run afresh
        shutil.rmtree(run_dir)
    result = train(cfg)
    return result, read_metrics(result["metrics_path"])


def default_train_fn() -> TrainFn:
    """``launcher.train.run``, imported only when a suite trains for real."""
    from launcher.train import run as train_run  # the integrator's training loop

    return train_run


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    *,
    headline_eta: int = HEADLINE_ETA,
    hidden: int | Sequence[int] | None = None,
    layers: int | None = None,
    engines: int | None = None,
    learner_ranks: int | None = None,
    batch: int | None = None,
    max_new_tokens: int | None = None,
    device: str | None = None,
    etas: Sequence[int] = ETAS,
    base_config: str | Path | None = None,
    train_fn: TrainFn | None = None,
    sizes: E2ESizes | None = None,
    placement: str | None = None,
    elastic: bool | None = None,
) -> dict[str, Any]:
    """Train every η ``reps`` times, alternated (and once with the bypass loss at the
    largest η); write ``e2e.json``. ``placement="colocated"``: co-located engines beside
    disaggregated ones instead (``bench.e2e_placement``); ``elastic``: engines joining a
    running job against the same engines from the start (``bench.e2e_elastic``)."""
    _check_etas(etas, headline_eta)
    started = time.monotonic()
    sizes = sizes or apply_size_flags(
        QUICK_SIZES if quick else FULL_SIZES,
        hidden=hidden,
        layers=layers,
        engines=engines,
        learner_ranks=learner_ranks,
        batch=batch,
        max_new_tokens=max_new_tokens,
        device=device,
    )
    reps = max(1, reps) if reps is not None else (QUICK_REPS if quick else FULL_REPS)
    if elastic:
        from bench import e2e_elastic

        return e2e_elastic.run(
            out_dir, sizes, reps, eta=headline_eta, base_config=base_config, train_fn=train_fn
        )
    if placement == "colocated":
        from bench import e2e_placement

        return e2e_placement.run(
            out_dir, sizes, reps, headline_eta=headline_eta, base_config=base_config,
            train_fn=train_fn,
        )  # fmt: skip
    base = Path(base_config) if base_config is not None else DEFAULT_BASE_CONFIG
    train = train_fn or default_train_fn()
    work = Path(out_dir) / "e2e"
    plan = run_plan(etas, reps)
    config = {
        "base_config": str(base),
        "etas": list(etas),
        "headline_eta": headline_eta,
        "reps": reps,
        "plan": [f"rep{rep} eta{eta} {correction}" for rep, eta, correction in plan],
        "sizes": dataclasses.asdict(sizes),
    }
    # Declared before any run: written now, so a reader can check it was not chosen after.
    declare_suite(out_dir, SUITE, config)
    progress = Progress(SUITE, total=len(plan))
    progress.note(f"headline η = {headline_eta} (declared); {reps} repetitions per η")
    workload = prepare_workload(work, sizes, base_config, progress)
    runs = _train_plan(plan, reps, max(etas), work, sizes, workload, train, base, progress)
    return _write_results(out_dir, config, runs, etas, headline_eta, workload.budget, started)


def _check_etas(etas: Sequence[int], headline_eta: int) -> None:
    """The grid needs η = 0 and an async bound; the headline η is one of the async bounds."""
    if 0 not in etas or len(etas) < 2:
        raise ValueError(f"e2e: etas must include 0 and at least one async bound, got {list(etas)}")
    if headline_eta not in etas or headline_eta == 0:
        raise ValueError(
            f"e2e: headline_eta must be one of the async bounds {[e for e in etas if e]},"
            f" got {headline_eta}"
        )


def _train_plan(
    plan: list[tuple[int, int, str]],
    reps: int,
    max_eta: int,
    work: Path,
    sizes: E2ESizes,
    workload: Workload,
    train: TrainFn,
    base: Path,
    progress: Progress,
) -> list[dict[str, Any]]:
    """Train each (rep, η, correction) of the plan in order; one record of figures per run."""
    runs: list[dict[str, Any]] = []
    for rep, eta, correction in plan:
        label = f"η={eta}" + (" bypass" if correction == "bypass" else "")
        run_dir = work / "runs" / f"rep{rep}-eta{eta}-{correction}"
        overrides = workload.overrides(
            sizes, eta=eta, correction=correction, run_dir=run_dir, max_eta=max_eta
        )
        progress.note(f"training {label} (rep {rep + 1}/{reps}) -> {run_dir}")
        result, rows = train_once(train, base, overrides, run_dir)
        figures = analyse_run(
            rows,
            samples_per_step=sizes.train_batch_size * sizes.group_size,
            warmup_steps=sizes.warmup_steps,
        )
        runs.append(
            {
                "label": label,
                "eta": eta,
                "correction": correction,
                "rep": rep,
                "run_dir": str(result.get("run_dir", run_dir)),
                "train_summary": {
                    k: v for k, v in result.items() if isinstance(v, int | float | str)
                },
                **figures,
            }
        )
        shown = {
            k: f"{v:.3g}" if isinstance(v, float) else v
            for k, v in figures.items()
            if k not in ("curve", "throughput_method")
        }
        progress.step(f"{label}: {shown}")
    return runs


def _write_results(
    out_dir: str | Path,
    config: dict[str, Any],
    runs: list[dict[str, Any]],
    etas: Sequence[int],
    headline_eta: int,
    budget_stats: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    """Summarise the runs (ratios, long tail, η sweep), write ``e2e.json`` and return it."""
    summary = summarise(runs, etas, headline_eta)
    lengths = [r["response_length_mean"] for r in runs if r["response_length_mean"] is not None]
    measured_length = median(lengths) if lengths else None
    long_tail = {
        "requested_budget": budget_stats,
        "measured_response_length_mean": measured_length,
        # the long tail is there when responses are about as long as the targets
        "honoured": None
        if measured_length is None
        else bool(measured_length >= 0.5 * budget_stats["mean"]),
    }
    summary["long_tail_honoured"] = long_tail["honoured"]
    sweep_rows = [
        {"x": eta, "series": {"samples/s (decoupled)": summary[f"samples_per_s_eta{eta}"]}}
        for eta in etas
    ]
    results = {"runs": runs, "long_tail": long_tail}
    sweep = {"x": "max_staleness η", "unit": "samples/s", "rows": sweep_rows}
    return write_suite(
        out_dir,
        SUITE,
        config=config,
        results=results,
        summary=summary,
        started=started,
        sweep=sweep,
    )
