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

Reward servers: ``run`` scores on servers already running (``reward_urls``) that serve
``reward_model`` (a one-label reward folder with the policy's tokenizer; a tiny random
one is built when none is given); ``run_served`` starts one itself (bench/reward_server.py:
``fleetrl engine`` over the folder, in a process of its own on loopback), runs both arms
on it and stops it by its process object, and adds what the server counted
(``server_scored_items``). ``fleetrl bench reward`` calls ``run_served`` through
bench/reward.py's ``e2e`` hook, after the batched-vs-per-sample half. On a CPU machine
the server shares the cores with the run's engine and learner, so the overhead measured
there includes that competition for cores; on GPU nodes the reward fleet has its own.

Left out: the cost when scoring cannot overlap (a synchronous trainer scoring at the
learner), reward servers sharing devices with the engines.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from bench import e2e
from bench.common import Progress, declare_suite, median, ratio, write_suite
from bench.reward_server import RewardServer
from rollout_fleet.engine.http_service import API_KEY_ENV

SUITE = "reward_e2e"
ARMS = ("rule", "model")
DEFAULT_ETA = 2
# the e2e suite's workload and sizes (a quick run: 2 repetitions x 2 arms of 32 steps)
QUICK_SIZES, FULL_SIZES = e2e.QUICK_SIZES, e2e.FULL_SIZES
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
    prepared = _prepare(out_dir, quick, sizes, base_config, reward_model)
    return _train_arms(prepared, reward_urls, quick=quick, reps=reps, eta=eta, train_fn=train_fn)


def run_served(
    out_dir: str | Path,
    quick: bool = False,
    *,
    reward_model: str | Path | None = None,
    reps: int | None = None,
    eta: int = DEFAULT_ETA,
    sizes: e2e.E2ESizes | None = None,
    base_config: str | Path | None = None,
    train_fn: e2e.TrainFn | None = None,
    server_factory: Callable[[Path], RewardServer] = RewardServer,
) -> dict[str, Any]:
    """``run`` on a reward server started here for the reward model, stopped after the runs
    (also when one fails). The summary adds what the server itself counted
    (``server_scored_requests``, ``server_scored_items``), which says the model arm's scores
    came from it."""
    prepared = _prepare(out_dir, quick, sizes, base_config, reward_model)
    prepared.progress.note(f"starting a reward server for {prepared.reward_model}")
    with server_factory(prepared.reward_model) as server:
        server.wait()
        prepared.progress.note(f"reward server at {server.url}")
        with mock.patch.dict(os.environ, {API_KEY_ENV: server.api_key}):  # api_key_env's default
            out = _train_arms(
                prepared, [server.url], quick=quick, reps=reps, eta=eta, train_fn=train_fn
            )
        info = server.info()
    out["summary"]["server_scored_requests"] = info.get("scored_requests")
    out["summary"]["server_scored_items"] = info.get("scored_items")
    out["config"]["server"] = "embedded reward engine (fleetrl engine), own process, loopback"
    write_suite(
        out_dir,
        SUITE,
        config=out["config"],
        results=out["results"],
        summary=out["summary"],
        started=prepared.started,
    )
    return out


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What both entry points share before training: the workload and the reward model."""

    out_dir: Path
    sizes: e2e.E2ESizes
    workload: e2e.Workload
    reward_model: Path
    progress: Progress
    started: float


def _prepare(
    out_dir: str | Path,
    quick: bool,
    sizes: e2e.E2ESizes | None,
    base_config: str | Path | None,
    reward_model: str | Path | None,
) -> _Prepared:
    started = time.monotonic()
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    work = Path(out_dir) / SUITE
    progress = Progress(SUITE)
    workload = e2e.prepare_workload(work, sizes, base_config, progress)
    folder = (
        Path(reward_model) if reward_model else build_reward_model(work, sizes, workload.model_dir)
    )
    return _Prepared(Path(out_dir), sizes, workload, folder, progress, started)


def _train_arms(
    prepared: _Prepared,
    reward_urls: Sequence[str],
    *,
    quick: bool,
    reps: int | None,
    eta: int,
    train_fn: e2e.TrainFn | None,
) -> dict[str, Any]:
    out_dir, sizes, workload, folder = (
        prepared.out_dir, prepared.sizes, prepared.workload, prepared.reward_model
    )  # fmt: skip
    reps = max(1, reps) if reps is not None else (e2e.QUICK_REPS if quick else e2e.FULL_REPS)
    train = train_fn or e2e.default_train_fn()
    work = out_dir / SUITE
    plan = run_plan(reps)
    progress = prepared.progress
    progress.total = len(plan)
    config = {
        "eta": eta,
        "reps": reps,
        "plan": [f"rep{rep} {arm}" for rep, arm in plan],
        "reward_model": str(folder),
        "reward_urls": list(reward_urls),
        "sizes": dataclasses.asdict(sizes),
    }
    declare_suite(out_dir, SUITE, config)
    runs: list[dict[str, Any]] = []
    for rep, arm in plan:
        run_dir = work / "runs" / f"rep{rep}-{arm}"
        overrides = workload.overrides(
            sizes, eta=eta, correction="decoupled", run_dir=run_dir, max_eta=eta
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
    return write_suite(
        out_dir,
        SUITE,
        config=config,
        results={"runs": runs},
        summary=summary,
        started=prepared.started,
    )
