"""Smoke: `fleetrl bench vs-trl` at a tiny size, and its evaluator against fleetrl's validation.

Both trainers run from their real commands (``fleetrl train`` on local Ray and
``python -m bench.trl_grpo`` on TRL's GRPOTrainer) for two steps of a one-layer
demo model; the shared evaluator scores their snapshots and the suite writes its
ratios. Not timed: a benchmark is never a test, the figures are only checked to
be there. Then the shared evaluator (transformers ``generate``, greedy) and
fleetrl's own validation (``fleetrl eval``: the embedded engine) score the same
snapshots, and must agree.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip(
    "trl", reason='TRL is not installed: pip install ".[bench]" in the fleetrl checkout'
)

from bench import vs_trl  # noqa: E402
from bench.vs_trl_regimes import DEMO  # noqa: E402

TINY_DEMO = dataclasses.replace(
    DEMO,
    total_steps=2,
    target_score=0.5,
    overrides=(
        "model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2",
        "model.warmstart.steps=30", "data.synth_train_size=64", "data.synth_test_size=24",
        "data.train_batch_size=4", "rollout.n=4",
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("vs-trl")
    return out, vs_trl.run(out, reps=1, arms=("fleetrl", "trl"), regimes=[TINY_DEMO])


def test_both_trainers_run_and_the_suite_reports_fleetrl_over_trl(suite):
    out, record = suite
    runs = record["results"]["runs"]
    assert sorted(r["arm"] for r in runs) == ["fleetrl", "trl"]
    for run in runs:
        assert run["returncode"] == 0 and run["command_s"] > 0
        assert run["steps"] == 2 and run["samples_per_s"] > 0
        assert [p["step"] for p in run["curve"]][0] == 0 and run["curve"][-1]["step"] == 2
        assert 0.0 <= run["final_score"] <= 1.0
    summary = record["summary"]
    for key in ("demo_command_speedup", "demo_samples_per_s_ratio"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert "demo_time_to_target_speedup" in summary
    assert (out / "vs-trl.json").is_file()


def test_the_shared_evaluator_agrees_with_fleetrls_own_validation(suite):
    from bench.held_out import HeldOutEvaluator
    from launcher.config import load_run_config
    from launcher.evaluate import evaluate
    from learner.snapshot import snapshot_root, snapshot_steps

    out, record = suite
    run = next(r for r in record["results"]["runs"] if r["arm"] == "fleetrl")
    cfg = load_run_config(f"{run['run_dir']}/config.yaml", [])
    folders = [path for _, path in snapshot_steps(snapshot_root(run["run_dir"]))]
    shared = HeldOutEvaluator(cfg.data.val_files, cfg.model.path, cfg.rollout.max_new_tokens)
    fleetrl = [r["val/score/mean"] for r in evaluate(cfg, folders)]
    assert [shared.score(folder) for folder in folders] == pytest.approx(fleetrl, abs=1e-9)
