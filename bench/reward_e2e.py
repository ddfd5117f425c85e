"""What reward-model scoring costs an RL step: rule scoring alone against rule + model scoring,
in the same suite, alternated, reported as a ratio (the goal: model scoring adds <= 10 % to
an e2e step when it overlaps generation).

Both arms are ``launcher.train.run`` on the e2e suite's workload (bench/e2e.py: the same
long-tailed data, the same warm-started model, the same sizes and staleness bound).
The model arm adds ``reward.model.path`` / ``reward.model.urls`` with
``reward.model.weight = 0``: every group is scored by the reward servers (one batched
``/classify`` call, overlapped with other groups' generation) and its scores are
reported, but the reward the policy learns from is the rule's alone, so both arms
train the same policy on the same responses and the difference is the scoring itself.
Repetition r runs rule then model, r + 1 model then rule (drift on a shared machine
hits both). Headline: ``model_vs_rule`` = median over repetitions of the paired ratio
samples/s(model) ÷ samples/s(rule), with min, max and every pair;
``model_scoring_overhead`` = 1 / model_vs_rule − 1 (the extra wall time per sample;
goal <= 0.10). The reward servers' group latency (``reward/group_latency_s/mean``) and
any scoring failures are recorded beside it.

The reward servers are not started here: ``reward_urls`` name servers already running
that serve ``reward_model`` (a one-label reward folder with the policy's tokenizer; a
tiny random one is built when none is given). ``fleetrl bench reward`` (bench/reward.py)
starts them and calls ``run``.

Left out: the cost when scoring cannot overlap (a synchronous trainer scoring at the
learner), reward servers sharing devices with the engines.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import e2e
from bench.common import Progress, median, ratio, suite_json_path, suite_record, write_json

SUITE = "reward_e2e"
ARMS = ("rule", "model")
DEFAULT_ETA = 2
SCORING_KEYS = ("reward/group_latency_s/mean", "reward/model_failed", "reward/samples_failed")


def run_plan(reps: int) -> list[tuple[int, str]]:
    """(rep, arm) in running order: rule then model, then the other way round, and so on."""
    return [(rep, arm) for rep in range(reps) for arm in (ARMS if rep % 2 == 0 else ARMS[::-1])]


def model_overrides(reward_model: Path, reward_urls: Sequence[str]) -> list[str]:
    """The model arm's extra overrides: scored and reported, weighed 0 in the reward."""
    return [
        f"reward.model.path={reward_model}",
        f"reward.model.urls=[{','.join(reward_urls)}]",
        "reward.model.weight=0.0",
        "reward.rule_weight=1.0",
    ]


def build_reward_model(work: Path, sizes: e2e.E2ESizes, policy_dir: Path) -> Path:
    """A tiny random reward model with the policy's tokenizer (built once per folder)."""
    from fleetrl.models.tiny import make_tiny_model

    folder = work / f"reward-model-h{sizes.hidden}-l{sizes.layers}"
    if (folder / "config.json").is_file():
        return folder
    import json

    positions = json.loads((policy_dir / "config.json").read_text())["max_position_embeddings"]
    return make_tiny_model(
        folder,
        hidden=sizes.hidden,
        layers=sizes.layers,
        heads=4,
        max_positions=int(positions),
        reward_model=True,
    )


def scoring_figures(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The model arm's scoring figures: mean group latency, failures at the end."""
    latencies = [v for r in rows if (v := e2e.first_number(r, SCORING_KEYS[:1])) is not None]
    last = rows[-1] if rows else {}
    return {
        "group_latency_s": median(latencies) if latencies else None,
        "model_failed": e2e.first_number(last, ("reward/model_failed",)),
        "samples_failed": e2e.first_number(last, ("reward/samples_failed",)),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def rate(arm: str, rep: int) -> float | None:
        for r in runs:
            if r["arm"] == arm and r["rep"] == rep:
                return r.get("samples_per_s")
        return None

    pairs = [
        value
        for rep in sorted({r["rep"] for r in runs})
        if (value := ratio(rate("model", rep), rate("rule", rep))) is not None
    ]
    headline = median(pairs) if pairs else None
    return {
        "model_vs_rule": headline,
        "model_vs_rule_min": min(pairs) if pairs else None,
        "model_vs_rule_max": max(pairs) if pairs else None,
        "model_vs_rule_pairs": pairs,
        "model_scoring_overhead": None if not headline else 1.0 / headline - 1.0,
        "repetitions": len({r["rep"] for r in runs}),
        "group_latency_s": median(
            [r["group_latency_s"] for r in runs if r.get("group_latency_s") is not None]
        )
        if any(r.get("group_latency_s") is not None for r in runs)
        else None,
    }


def run(
    out_dir: str | Path,
    *,
    reward_urls: Sequence[str],
    reward_model: str | Path | None = None,
    quick: bool = False,
    reps: int | None = None,
    eta: int = DEFAULT_ETA,
    sizes: e2e.E2ESizes | None = None,
    base_config: str | Path | None = None,
    train_fn: e2e.TrainFn | None = None,
) -> dict[str, Any]:
    """Train both arms ``reps`` times, alternated, on servers at ``reward_urls``; write
    ``reward_e2e.json``."""
    if not reward_urls:
        raise ValueError("reward_e2e: give the reward servers' URLs (reward_urls)")
    started = time.monotonic()
    sizes = sizes or (e2e.QUICK_SIZES if quick else e2e.FULL_SIZES)
    reps = max(1, reps) if reps is not None else (e2e.QUICK_REPS if quick else e2e.FULL_REPS)
    train = train_fn or e2e.default_train_fn()
    work = Path(out_dir) / SUITE
    plan = run_plan(reps)
    progress = Progress(SUITE, total=len(plan))
    workload = e2e.prepare_workload(work, sizes, base_config, progress)
    folder = (
        Path(reward_model) if reward_model else build_reward_model(work, sizes, workload.model_dir)
    )
    config = {
        "eta": eta,
        "reps": reps,
        "plan": [f"rep{rep} {arm}" for rep, arm in plan],
        "reward_model": str(folder),
        "reward_urls": list(reward_urls),
        "sizes": dataclasses.asdict(sizes),
    }
    write_json(
        suite_json_path(out_dir, SUITE),
        suite_record(SUITE, config=config, error="running: no figures yet"),
    )
    runs: list[dict[str, Any]] = []
    for rep, arm in plan:
        run_dir = work / "runs" / f"rep{rep}-{arm}"
        overrides = e2e.run_overrides(
            sizes,
            eta=eta,
            correction="decoupled",
            run_dir=run_dir,
            model_dir=workload.model_dir,
            train_file=workload.train_file,
            val_file=workload.val_file,
            max_eta=eta,
        )
        if arm == "model":
            overrides += model_overrides(folder, reward_urls)
        progress.note(f"training the {arm} arm (rep {rep + 1}/{reps}) -> {run_dir}")
        _, rows = e2e.train_once(train, workload.base_config, overrides, run_dir)
        figures = e2e.analyse_run(
            rows,
            samples_per_step=sizes.train_batch_size * sizes.group_size,
            warmup_steps=sizes.warmup_steps,
        )
        if arm == "model":
            figures.update(scoring_figures(rows))
        runs.append({"arm": arm, "rep": rep, "run_dir": str(run_dir), **figures})
        progress.step(f"{arm}: samples/s {figures['samples_per_s']}")
    summary = summarise(runs)
    write_json(
        suite_json_path(out_dir, SUITE),
        suite_record(
            SUITE,
            config=config,
            results={"runs": runs},
            summary=summary,
            wall_s=time.monotonic() - started,
        ),
    )
    return {"config": config, "results": {"runs": runs}, "summary": summary}
