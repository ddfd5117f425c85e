"""``fleetrl bench e2e --placement colocated``: co-located engines beside disaggregated ones.

The end-to-end suite's workload (``bench.e2e``: the real training loop on the demo base
config, long-tailed response lengths, the same data and warm-started model), run with
``rollout.placement`` = disaggregated and = colocated on the same resources: the same
engines, learner ranks, CPUs per rank and per engine (co-located, each bundle holds a
rank's and its engine's CPUs: the same total), at η = 0 and at the declared η. Each
repetition runs every (η, placement) pair, the order reversed on the next repetition,
so load drift on a shared machine hits both alike.

Figures per run (``metrics.jsonl``): samples/s as the e2e suite measures it, and for a
co-located run the switch: release + onload + resume of the weights + push + resume of
the KV cache + offload, in seconds per step (``colocate/*``), and as a share of the step
(``timing_s/step``); ``colocate/bytes_released`` per step.

Headline: ``colocated_vs_disaggregated`` = the median over repetitions of the paired
ratio samples/s(colocated) ÷ samples/s(disaggregated) at the declared η (and at η = 0,
``_eta0``), with its min and max; ``switch_share`` = the median share of a co-located
step spent switching. On CPU the roles do not compete for memory, so co-location only
takes turns where the disaggregated run overlaps: expect a ratio below 1 here; the case
for co-location is a GPU node whose memory cannot hold both roles at once (docs/colocation.md).

Left out: a GPU measurement (no GPU on the machine that runs ``make bench``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from bench.common import Progress, declare_suite, median, ratio, write_suite
from bench.e2e import (
    SUITE,
    E2ESizes,
    TrainFn,
    analyse_run,
    default_train_fn,
    first_number,
    prepare_workload,
    train_once,
)

PLACEMENTS = ("disaggregated", "colocated")
# the per-step parts of the switch, as metrics.jsonl names them
SWITCH_KEYS = (
    "colocate/release_s",
    "colocate/onload_s",
    "colocate/resume_weights_s",
    "colocate/push_s",
    "colocate/resume_kv_s",
    "colocate/offload_s",
)


def switch_figures(rows: list[dict[str, Any]], warmup_steps: int) -> dict[str, float | None]:
    """Mean seconds per measured step spent switching, its share of the step, bytes released."""
    train = [r for r in rows if first_number(r, ("timing_s/step",)) is not None][warmup_steps:]
    switches, shares, released = [], [], []
    for row in train:
        parts = [first_number(row, (k,)) for k in SWITCH_KEYS]
        if all(p is None for p in parts):
            continue
        switch = sum(p or 0.0 for p in parts)
        switches.append(switch)
        shares.append(switch / row["timing_s/step"] if row["timing_s/step"] > 0 else 0.0)
        if (nbytes := first_number(row, ("colocate/bytes_released",))) is not None:
            released.append(nbytes)
    return {
        "switch_s": sum(switches) / len(switches) if switches else None,
        "switch_share": sum(shares) / len(shares) if shares else None,
        "bytes_released": sum(released) / len(released) if released else None,
    }


def run_plan(etas: tuple[int, ...], reps: int) -> list[tuple[int, int, str]]:
    """(rep, η, placement) in running order; a repetition's order reversed on the next."""
    pairs = [(eta, placement) for eta in etas for placement in PLACEMENTS]
    plan = []
    for rep in range(reps):
        order = pairs if rep % 2 == 0 else list(reversed(pairs))
        plan += [(rep, eta, placement) for eta, placement in order]
    return plan


def summarise(runs: list[dict[str, Any]], etas: tuple[int, ...], headline_eta: int) -> dict:
    def rate(eta: int, placement: str, rep: int) -> float | None:
        for r in runs:
            if (r["eta"], r["placement"], r["rep"]) == (eta, placement, rep):
                return r.get("samples_per_s")
        return None

    summary: dict[str, Any] = {"headline_eta": headline_eta}
    for eta in etas:
        pairs = [
            value
            for rep in sorted({r["rep"] for r in runs})
            if (value := ratio(rate(eta, "colocated", rep), rate(eta, "disaggregated", rep)))
            is not None
        ]
        key = f"colocated_vs_disaggregated_eta{eta}"
        summary[key] = median(pairs) if pairs else None
        summary[f"{key}_min"] = min(pairs) if pairs else None
        summary[f"{key}_max"] = max(pairs) if pairs else None
        summary[f"{key}_pairs"] = pairs
        for placement in PLACEMENTS:
            mine = [
                r["samples_per_s"]
                for r in runs
                if (r["eta"], r["placement"]) == (eta, placement) and r.get("samples_per_s")
            ]
            summary[f"samples_per_s_{placement}_eta{eta}"] = median(mine) if mine else None
    for suffix in ("", "_min", "_max", "_pairs"):
        summary[f"colocated_vs_disaggregated{suffix}"] = summary.get(
            f"colocated_vs_disaggregated_eta{headline_eta}{suffix}"
        )
    colocated = [r for r in runs if r["placement"] == "colocated"]
    for key in ("switch_s", "switch_share", "bytes_released"):
        values = [r[key] for r in colocated if r.get(key) is not None]
        summary[key] = median(values) if values else None
    summary["repetitions"] = len({r["rep"] for r in runs})
    return summary


def run(
    out_dir: str | Path,
    sizes: E2ESizes,
    reps: int,
    *,
    headline_eta: int,
    base_config: str | Path | None = None,
    train_fn: TrainFn | None = None,
) -> dict[str, Any]:
    """Every (η, placement) pair ``reps`` times, alternated; write ``e2e.json``."""
    started = time.monotonic()
    etas = (0, headline_eta)
    train = train_fn or default_train_fn()
    work = Path(out_dir) / "e2e"
    plan = run_plan(etas, reps)
    config = {
        "placement": "colocated",
        "compared_with": "disaggregated",
        "etas": list(etas),
        "headline_eta": headline_eta,
        "reps": reps,
        "plan": [f"rep{rep} eta{eta} {placement}" for rep, eta, placement in plan],
        "sizes": dataclasses.asdict(sizes),
    }
    declare_suite(out_dir, SUITE, config)
    progress = Progress(SUITE, total=len(plan))
    workload = prepare_workload(work, sizes, base_config, progress)
    runs: list[dict[str, Any]] = []
    for rep, eta, placement in plan:
        run_dir = work / "runs" / f"rep{rep}-eta{eta}-{placement}"
        overrides = workload.overrides(
            sizes, eta=eta, correction="decoupled", run_dir=run_dir, max_eta=headline_eta
        ) + [f"rollout.placement={placement}"]
        progress.note(f"training η={eta} {placement} (rep {rep + 1}/{reps}) -> {run_dir}")
        result, rows = train_once(train, workload.base_config, overrides, run_dir)
        figures = analyse_run(
            rows,
            samples_per_step=sizes.train_batch_size * sizes.group_size,
            warmup_steps=sizes.warmup_steps,
        )
        figures.update(switch_figures(rows, sizes.warmup_steps))
        runs.append(
            {
                "label": f"η={eta} {placement}",
                "eta": eta,
                "placement": placement,
                "correction": "decoupled",
                "rep": rep,
                "run_dir": str(result.get("run_dir", run_dir)),
                **figures,
            }
        )
        progress.step(
            f"η={eta} {placement}: samples/s {figures['samples_per_s']}, "
            f"switch share {figures['switch_share']}"
        )
    summary = summarise(runs, etas, headline_eta)
    results = {"runs": runs}
    return write_suite(
        out_dir, SUITE, config=config, results=results, summary=summary, started=started
    )
