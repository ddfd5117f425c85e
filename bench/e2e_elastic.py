"""``fleetrl bench e2e --elastic``: what an engine joining a running job costs and brings.

The end-to-end suite's workload (``bench.e2e``: the real training loop on the demo base
config, long-tailed response lengths, the same data and warm-started model), run two
ways on the same machine, alternated over repetitions (the order reversed on the next):

- **join**: ``rollout.elastic=true``, one engine at the start, ``max_engines`` = the
  engines of the other arm; after ``join_step`` steps a thread runs what
  ``fleetrl fleet scale --engines N`` runs (``launcher.fleet_control.call``) and the fleet
  places the others while training goes on;
- **fixed**: N engines from the start.

Figures per join run (its ``metrics.jsonl``): the step at which every joined engine
served (``fleet/joins``), the seconds from placement to serving (``fleet/join_s_max``),
and samples/s over steps, the same step windows in both arms:

Each run trains ``ELASTIC_STEPS_QUICK`` steps (``ELASTIC_STEPS_FULL`` for the full sizes):
an engine takes tens of seconds to start (a process, torch, the model) while a quick step
takes well under one, and the compared window must come after the join. Validation runs
once, at the end.

- ``before``: the measured steps before the scale request (one engine against N);
- ``after``: from two versions after the join (``sync_every`` steps per version) to the
  end: the headline ``join_vs_fixed`` = samples/s(join, after) ÷ samples/s(fixed, the same
  steps), median over repetitions, goal >= 0.9;
- ``others_lost_share``: the generation time the engines already serving lost to the
  join, as a share of the wall time from the scale request to two versions after the
  join: the pauses of those versions beyond the run's median pause per version
  (``weight_sync/paused_s``), plus the re-formation of the weight group counted whole
  (``fleet/regroup_s``: SGLang's schedulers hold generation for it; the embedded engine
  forms it on a thread of its own while it generates, so this over-counts there). Goal
  <= 5 %.

Left out: a GPU measurement, and joins caused by a node arriving (``fleetrl fleet scale``
stands in for it: placement on a new node is the same code after the node is seen).
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Progress, declare_suite, median, ratio, write_suite
from bench.e2e import (
    SUITE,
    E2ESizes,
    TrainFn,
    default_train_fn,
    first_number,
    prepare_workload,
    read_metrics,
    train_once,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

ARMS = ("join", "fixed")
JOIN_STEP = 6  # the scale request is sent once this many steps are logged
# steps of each run: an engine takes tens of seconds to start (a process, torch, the model)
# while a quick step takes well under one, so the run must outlast the join by a window
ELASTIC_STEPS_QUICK, ELASTIC_STEPS_FULL = 200, 400
VERSIONS_TO_SETTLE = 2  # the goal: within two versions of the join
GOAL_RATIO = 0.9
GOAL_LOST_SHARE = 0.05


class ScaleAt(threading.Thread):
    """Sends one scale request to the run in ``run_dir`` once ``step`` steps are logged."""

    def __init__(self, run_dir: Path, step: int, engines: int) -> None:
        super().__init__(name="bench-scale", daemon=True)
        self.run_dir, self.step, self.engines = run_dir, step, engines
        self.sent_at_step: int | None = None
        self.error = ""
        self._done = threading.Event()

    def run(self) -> None:
        from launcher.fleet_control import ControlError, ErrorReply, ScaleRequest, call

        metrics = self.run_dir / "metrics.jsonl"
        while not self._done.wait(0.2):
            rows = read_metrics(metrics) if metrics.is_file() else []
            steps = [r["step"] for r in rows if first_number(r, ("timing_s/step",)) is not None]
            if len(steps) < self.step:
                continue
            try:
                reply = call(self.run_dir, ScaleRequest(fleet="rollout", engines=self.engines))
            except FileNotFoundError:  # not serving its endpoint yet
                continue
            except (ControlError, OSError, ValueError) as err:
                self.error = str(err)
                return
            if isinstance(reply, ErrorReply):
                self.error = reply.message
            self.sent_at_step = steps[-1]
            return

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


def window_rate(rows: list[dict[str, Any]], first: int, last: int, per_step: int) -> float | None:
    """Samples/s over training steps ``first``..``last`` (by their logged wall clock)."""
    train = [r for r in rows if first_number(r, ("timing_s/step",)) is not None]
    clock = {r["step"]: first_number(r, ("time/elapsed_s",)) for r in train}
    if first - 1 not in clock or last not in clock or last < first:
        return None
    return ratio((last - first + 1) * per_step, clock[last] - clock[first - 1])


def join_figures(rows: list[dict[str, Any]], sent_at: int | None, sync_every: int) -> dict:
    """When the join completed, what it took, and what it cost the engines already serving."""
    train = [r for r in rows if first_number(r, ("timing_s/step",)) is not None]
    joined = next((r["step"] for r in train if (r.get("fleet/joins") or 0) >= 1 and (r.get("fleet/engines") or 0) >= (r.get("fleet/engines_target") or 0)), None)  # fmt: skip
    out: dict[str, Any] = {"scale_sent_at_step": sent_at, "joined_at_step": joined}
    if sent_at is None or joined is None:
        return out
    settled = joined + VERSIONS_TO_SETTLE * sync_every
    out["settled_at_step"] = settled
    out["join_s_max"] = max((r.get("fleet/join_s_max") or 0.0 for r in train), default=0.0)
    pauses = [p for r in train if (p := first_number(r, ("weight_sync/paused_s",))) is not None]
    typical = median(pauses) if pauses else 0.0
    window = [r for r in train if sent_at < r["step"] <= settled]
    extra = sum(max(0.0, (first_number(r, ("weight_sync/paused_s",)) or 0.0) - typical) for r in window)  # fmt: skip
    regroup = sum(first_number(r, ("fleet/regroup_s",)) or 0.0 for r in window)
    clock = {r["step"]: first_number(r, ("time/elapsed_s",)) for r in train}
    wall = (clock.get(settled) or 0.0) - (clock.get(sent_at) or 0.0)
    out.update(
        extra_pause_s=extra,
        regroup_s=regroup,
        window_s=wall,
        others_lost_share=ratio(extra + regroup, wall) if wall > 0 else None,
    )
    return out


def run(
    out_dir: str | Path,
    sizes: E2ESizes,
    reps: int,
    *,
    eta: int,
    base_config: str | Path | None = None,
    train_fn: TrainFn | None = None,
    join_step: int = JOIN_STEP,
) -> dict[str, Any]:
    """Both arms ``reps`` times, alternated; write ``e2e.json`` (see the module docstring)."""
    started = time.monotonic()
    engines = max(2, sizes.engines)
    steps = ELASTIC_STEPS_QUICK if sizes.total_steps <= ELASTIC_STEPS_QUICK else ELASTIC_STEPS_FULL
    # validation once, at the end: the same for both arms, outside the compared windows
    sizes = dataclasses.replace(sizes, engines=engines, total_steps=steps, test_freq=steps)
    train = train_fn or default_train_fn()
    work = Path(out_dir) / "e2e"
    plan = [(rep, arm) for rep in range(reps) for arm in (ARMS if rep % 2 == 0 else ARMS[::-1])]
    config = {
        "elastic": True,
        "eta": eta,
        "engines": engines,
        "join_step": join_step,
        "reps": reps,
        "plan": [f"rep{rep} {arm}" for rep, arm in plan],
        "sizes": dataclasses.asdict(sizes),
        "goals": {
            "join_vs_fixed": f">= {GOAL_RATIO}",
            "others_lost_share": f"<= {GOAL_LOST_SHARE}",
        },  # fmt: skip
    }
    declare_suite(out_dir, SUITE, config)
    progress = Progress(SUITE, total=len(plan))
    workload = prepare_workload(work, sizes, base_config, progress)
    per_step = sizes.train_batch_size * sizes.group_size
    runs: list[dict[str, Any]] = []
    for rep, arm in plan:
        run_dir = work / "runs" / f"rep{rep}-elastic-{arm}"
        overrides = workload.overrides(sizes, eta=eta, correction="decoupled", run_dir=run_dir, max_eta=eta)  # fmt: skip
        scaler = None
        shutil.rmtree(run_dir, ignore_errors=True)  # no earlier run's metrics for the scaler
        if arm == "join":
            overrides += ["rollout.num_engines=1", "rollout.elastic=true", f"rollout.max_engines={engines}"]  # fmt: skip
            scaler = ScaleAt(run_dir, join_step, engines)
            scaler.start()
        progress.note(f"training {arm} (rep {rep + 1}/{reps}) -> {run_dir}")
        try:
            result, rows = train_once(train, workload.base_config, overrides, run_dir)
        finally:
            if scaler is not None:
                scaler.stop()
        entry: dict[str, Any] = {"arm": arm, "rep": rep, "run_dir": str(result.get("run_dir", run_dir)), "rows": rows}  # fmt: skip
        if scaler is not None:
            entry.update(join_figures(rows, scaler.sent_at_step, 1), scale_error=scaler.error)
        runs.append(entry)
        progress.step(f"{arm}: " + ", ".join(f"{k} {v}" for k, v in entry.items() if k not in ("rows", "run_dir")))  # fmt: skip
    summary = summarise(runs, sizes, per_step)
    results = {"runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs]}
    return write_suite(
        out_dir, SUITE, config=config, results=results, summary=summary, started=started
    )


def summarise(runs: list[dict[str, Any]], sizes: E2ESizes, per_step: int) -> dict[str, Any]:
    """Per repetition, the join run's windows against the fixed run's same steps; medians."""
    after, before, lost, join_s = [], [], [], []
    for rep in sorted({r["rep"] for r in runs}):
        joined = next((r for r in runs if r["rep"] == rep and r["arm"] == "join"), None)
        fixed = next((r for r in runs if r["rep"] == rep and r["arm"] == "fixed"), None)
        if joined is None or fixed is None or joined.get("settled_at_step") is None:
            continue
        steps = [[r["step"] for r in run["rows"] if "timing_s/step" in r] for run in (joined, fixed)]  # fmt: skip
        last, sent = min(max(s, default=0) for s in steps), joined["scale_sent_at_step"]
        settled = joined["settled_at_step"]
        start = sizes.warmup_steps + 1
        pair = ratio(window_rate(joined["rows"], settled + 1, last, per_step), window_rate(fixed["rows"], settled + 1, last, per_step))  # fmt: skip
        if pair is not None:
            after.append(pair)
        early = ratio(window_rate(joined["rows"], start, sent, per_step), window_rate(fixed["rows"], start, sent, per_step))  # fmt: skip
        if early is not None:
            before.append(early)
        if joined.get("others_lost_share") is not None:
            lost.append(joined["others_lost_share"])
        join_s.append(joined["join_s_max"])
    summary: dict[str, Any] = {
        "join_vs_fixed": median(after) if after else None,
        "join_vs_fixed_pairs": after,
        "before_join_vs_fixed": median(before) if before else None,
        "others_lost_share": median(lost) if lost else None,
        "others_lost_share_runs": lost,
        "join_s": median(join_s) if join_s else None,
        "repetitions": len({r["rep"] for r in runs}),
    }
    summary["join_goal_met"] = None if summary["join_vs_fixed"] is None else summary["join_vs_fixed"] >= GOAL_RATIO  # fmt: skip
    summary["lost_goal_met"] = None if summary["others_lost_share"] is None else summary["others_lost_share"] <= GOAL_LOST_SHARE  # fmt: skip
    return summary
