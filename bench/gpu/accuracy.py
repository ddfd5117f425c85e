"""Stage ``accuracy``: time to the target score, η = 4 against synchronous training, on the device.

On two CPU cores a synchronous step waits only 28 % of its time for generation, so
overlapping generation with training can buy at most 1.38× (README, ``fleetrl bench
accuracy``). On a GPU the learner's step on the tiny model is short and decode is bound by
memory traffic and kernel launches, so generation dominates a synchronous step: the regime
where the asynchronous loop should reach a score sooner. This stage runs the accuracy
suite's grid reduced to its question: ``bench.accuracy.run`` with η ∈ {0, 4} (decoupled
correction), one seed, the suite's workload (``FULL_SIZES``: add2, 8 prompts × 8 samples,
long-tailed responses up to 48 tokens, the target score 0.75 declared for it) on CUDA for
40 steps with a policy snapshot every 4, the base config ``configs/demo_cpu.yaml`` placed on
the one GPU (``GPU_PLACEMENT``: learner and engine half a GPU each, bf16, gloo).

Figures: the suite's summary (``time_to_target_vs_sync`` = sync's time to target ÷ η = 4's,
``final_gap_eta4``, ``sync_generation_share``: the share of a sync step spent waiting for
generation, and ``overlap_speedup_bound`` = 1 / (1 − share)), each run's final score and
time to target. It passes when both runs finished and were scored; reaching the target is a
figure, not a condition. On CPU the runs are tiny (``SIZES``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bench.gpu.stage import CheckFailed, StageContext

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "configs" / "demo_cpu.yaml"
ETAS = (0, 4)
# configs/demo_cpu.yaml's run, placed on one GPU (the rest of the workload unchanged)
GPU_PLACEMENT = [
    "trainer.device=cuda",
    "learner.gpus_per_rank=0.5",
    "rollout.gpus_per_engine=0.5",
    "learner.mixed_precision=bf16",
    "model.dtype=bfloat16",
    "weight_sync.backend=gloo",  # NCCL refuses two ranks on one device
    "ray.num_gpus=1",  # declared: a local instance need not detect the device
]
SUMMARY_KEYS = (
    "time_to_target_vs_sync",
    "final_gap_eta4",
    "sync_generation_share",
    "overlap_speedup_bound",
    "target_score",
    "grid_complete",
)


def sizes_for(device: str) -> Any:
    from bench.accuracy import FULL_SIZES

    if device == "cuda":
        workload = dataclasses.replace(FULL_SIZES.workload, total_steps=40, device="cuda")
        return dataclasses.replace(FULL_SIZES, workload=workload, seeds=(0,))
    workload = dataclasses.replace(
        FULL_SIZES.workload, total_steps=4, warmup_steps=1, test_freq=2, train_batch_size=2,
        group_size=2, max_new_tokens=8, budget_median=2.0, train_size=40, val_size=10,
        warmstart_steps=20, device="cpu",
    )  # fmt: skip
    return dataclasses.replace(FULL_SIZES, workload=workload, seeds=(0,))


def base_config(device: str, work: Path) -> Path:
    """``configs/demo_cpu.yaml``, placed on the GPU for CUDA (written into ``work``)."""
    if device != "cuda":
        return BASE_CONFIG
    import yaml

    from fleetrl.config import apply_overrides, load_yaml

    path = work / "base_config.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(load_yaml(BASE_CONFIG), GPU_PLACEMENT)))
    return path


def run(ctx: StageContext) -> None:
    from bench.accuracy import run as accuracy_run
    from bench.common import read_json, suite_json_path

    sizes = sizes_for(ctx.device)
    ctx.figures.update(etas=list(ETAS), sizes=dataclasses.asdict(sizes.workload))
    try:
        accuracy_run(
            ctx.work, etas=ETAS, bypass_eta=None, sizes=sizes,
            base_config=base_config(ctx.device, ctx.work),
        )  # fmt: skip
    finally:  # what the grid wrote so far (after each run), also when the stage was stopped
        record_path = suite_json_path(ctx.work, "accuracy")
        if record_path.is_file():
            record = read_json(record_path)
            summary = record.get("summary", {})
            ctx.figures.update({k: summary.get(k) for k in SUMMARY_KEYS})
            for r in record.get("results", {}).get("runs", []):
                key = f"eta{r['eta']}"
                ctx.figures[f"final_score_{key}"] = r.get("final_score")
                ctx.figures[f"time_to_target_s_{key}"] = r.get("time_to_target_s")
                ctx.figures[f"step_to_target_{key}"] = r.get("step_to_target")
                ctx.figures[f"train_wall_s_{key}"] = r.get("train_wall_s")
                ctx.figures[f"trainer_idle_fraction_{key}"] = r.get("trainer_idle_fraction")
    finals = [ctx.figures.get(f"final_score_eta{eta}") for eta in ETAS]
    if not ctx.figures.get("grid_complete") or any(f is None for f in finals):
        raise CheckFailed(f"the grid did not finish with a score per run: {finals}")
