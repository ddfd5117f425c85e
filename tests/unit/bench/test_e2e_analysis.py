"""bench.e2e without Ray: budgets, overrides, metrics analysis and the suite driven by a fake trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench import e2e, e2e_workload
from bench.common import read_json
from launcher.config import load_run_config

TINY = e2e.dataclasses.replace(
    e2e.QUICK_SIZES,
    total_steps=6,
    warmup_steps=2,
    test_freq=3,
    train_size=40,
    val_size=5,
    hidden=16,
    layers=1,
    warmstart_steps=0,
)


def test_budgets_are_long_tailed_and_within_the_cap():
    sizes = e2e.dataclasses.replace(TINY, max_new_tokens=64, budget_median=4.0, budget_sigma=1.0)
    budgets = e2e_workload.long_tail_budgets(5000, sizes, seed=0)
    assert budgets.min() >= 2 and budgets.max() <= 64
    # long tail: the mean sits well above the median, and the cap is reached
    assert budgets.mean() > 1.3 * float(sorted(budgets)[len(budgets) // 2])
    assert budgets.max() == 64


def test_train_rows_carry_budgets_and_validation_rows_do_not(tmp_path):
    train, val, stats = e2e_workload.write_long_tail_data(tmp_path, TINY)
    train_info = pq.read_table(train).column("extra_info").to_pylist()
    val_info = pq.read_table(val).column("extra_info").to_pylist()
    assert all(2 <= row["max_new_tokens"] <= TINY.max_new_tokens for row in train_info)
    assert all("max_new_tokens" not in row for row in val_info)
    assert stats["max"] <= TINY.max_new_tokens and stats["p90"] >= stats["p50"]


def test_warm_start_answers_are_noised_first_then_padded_to_the_length_target(tmp_path):
    train, _, _ = e2e_workload.write_long_tail_data(tmp_path, TINY)
    table = pq.read_table(train).to_pylist()
    clean = e2e_workload.padded_examples(train, label_noise=0.0, seed=0)
    noisy = e2e_workload.padded_examples(train, label_noise=1.0, seed=0)
    for row, (_, answer), (_, wrong) in zip(table, clean, noisy, strict=True):
        truth = row["reward_model"]["ground_truth"]
        target = row["extra_info"]["max_new_tokens"] - 1
        assert answer.strip() == truth and len(answer) == max(target, len(truth))
        assert wrong.strip() == str(int(truth) + 1) and len(wrong) >= target


def test_the_synth_scorer_ignores_the_padding():
    from rollout_fleet.rewards.synth import compute_score

    assert compute_score("8" + e2e_workload.PAD * 20, "8")["score"] == 1.0


def test_overrides_make_a_valid_run_config_that_differs_only_in_eta_and_correction(tmp_path):
    common = dict(
        run_dir=tmp_path / "r",
        model_dir=tmp_path / "m",
        train_file=tmp_path / "t.parquet",
        val_file=tmp_path / "v.parquet",
        max_eta=4,
    )
    sync = load_run_config(
        e2e.DEFAULT_BASE_CONFIG,
        e2e.run_overrides(TINY, eta=0, correction="decoupled", **common),
    )
    bypass = load_run_config(
        e2e.DEFAULT_BASE_CONFIG,
        e2e.run_overrides(TINY, eta=4, correction="bypass", **common),
    )
    assert sync.buffer.max_staleness == 0 and bypass.buffer.max_staleness == 4
    assert (
        sync.learner.correction.mode == "decoupled" and bypass.learner.correction.mode == "bypass"
    )
    assert sync.rollout.max_concurrent_groups == bypass.rollout.max_concurrent_groups == 5 * 4
    assert sync.data.train_files == [str(tmp_path / "t.parquet")] and sync.data.synth_task == ""
    assert sync.model.path == str(tmp_path / "m") and not sync.model.create_tiny


def _rows(step_s: float, gen_s: float, steps: int, val_every: int) -> list[dict]:
    rows = [{"step": 0, "policy_version": 0, "val/score/mean": 0.1}]
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "timing_s/step": step_s + (5.0 if step % val_every == 0 else 0.0),
            "timing_s/gen": gen_s,
            "rollout/idle_fraction": 0.25,
            "response_length/mean": 6.0,
            "staleness/max": 1.0,
        }
        if step % val_every == 0:
            row["val/score/mean"] = 0.1 + step / 100
        rows.append(row)
    return rows


def test_analysis_leaves_out_warmup_validation_steps_and_the_last_step():
    figures = e2e.analyse_run(_rows(2.0, 0.5, 9, 3), samples_per_step=16, warmup_steps=2)
    # measured steps 3..9; steps 3, 6, 9 validated (9 is also the last): 4, 5, 7, 8 remain
    assert figures["throughput_method"] == "steps"
    assert figures["samples_per_s"] == pytest.approx(16 / 2.0)
    assert figures["curve"][0] == [0.0, 0.1] and figures["final_val_score"] == pytest.approx(0.19)
    assert figures["trainer_idle_fraction"] == pytest.approx(7 * 0.5 / (7 * 2.0 + 3 * 5.0))
    assert figures["rollout_idle_fraction"] == 0.25 and figures["staleness_max"] == 1.0


def test_analysis_subtracts_validation_time_when_the_run_reports_it():
    rows = _rows(2.0, 0.5, 9, 3)
    for row in rows[1:]:
        if "val/score/mean" in row:
            row["timing_s/validate"] = 5.0
    figures = e2e.analyse_run(rows, samples_per_step=16, warmup_steps=2)
    assert figures["throughput_method"] == "window"
    assert figures["samples_per_s"] == pytest.approx(7 * 16 / (7 * 2.0))


def test_summary_picks_the_best_async_eta_and_reports_the_correction_effect():
    runs = [
        {"eta": 0, "correction": "decoupled", "samples_per_s": 10.0, "final_val_score": 0.5},
        {"eta": 1, "correction": "decoupled", "samples_per_s": 14.0, "final_val_score": 0.5},
        {"eta": 4, "correction": "decoupled", "samples_per_s": 18.0, "final_val_score": 0.6},
        {"eta": 4, "correction": "bypass", "samples_per_s": 18.0, "final_val_score": 0.4},
    ]
    summary = e2e.summarise(runs, (0, 1, 4))
    assert summary["async_vs_sync"] == pytest.approx(1.8) and summary["best_eta"] == 4
    assert summary["val_score_bypass_eta4"] == 0.4
    assert summary["correction_score_gain"] == pytest.approx(0.2)
    assert summary["trainer_idle_eta1"] is None


def test_run_drives_one_training_per_eta_plus_bypass_and_writes_e2e_json(tmp_path):
    seen: list[tuple[int, str]] = []

    def fake_train(cfg):
        eta = cfg.buffer.max_staleness
        seen.append((eta, cfg.learner.correction.mode))
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True)
        metrics = run_dir / "metrics.jsonl"
        rows = _rows(2.0 / (1 + eta), 0.1, cfg.trainer.total_steps, cfg.trainer.test_freq)
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"run_dir": str(run_dir), "metrics_path": str(metrics), "wall_s": 1.0}

    out = e2e.run(tmp_path, quick=True, etas=(0, 1, 2), train_fn=fake_train, sizes=TINY)
    assert seen == [(0, "decoupled"), (1, "decoupled"), (2, "decoupled"), (2, "bypass")]
    assert out["summary"]["async_vs_sync"] == pytest.approx(3.0)
    assert out["summary"]["best_eta"] == 2
    record = read_json(tmp_path / "e2e.json")
    assert record["status"] == "ok" and len(record["results"]["runs"]) == 4
    assert record["results"]["long_tail"]["honoured"] is (
        0.5 * record["results"]["long_tail"]["requested_budget"]["mean"] <= 6.0
    )
    assert [row["x"] for row in record["sweep"]["rows"]] == [0, 1, 2]


def test_run_refuses_etas_without_the_synchronous_baseline(tmp_path):
    with pytest.raises(ValueError, match="include 0"):
        e2e.run(tmp_path, quick=True, etas=(1, 2), train_fn=lambda cfg: {}, sizes=TINY)
