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


def test_analysis_charges_the_whole_window_validations_included():
    figures = e2e.analyse_run(_rows(2.0, 0.5, 9, 3), samples_per_step=16, warmup_steps=2)
    # measured steps 3..9; steps 3, 6, 9 validated (5 s each), inside the window like the rest
    window = 7 * 2.0 + 3 * 5.0
    assert figures["window_s"] == pytest.approx(window)
    assert figures["samples_per_s"] == pytest.approx(7 * 16 / window)
    assert figures["curve"][0] == [0.0, 0.1] and figures["final_val_score"] == pytest.approx(0.19)
    assert figures["trainer_idle_fraction"] == pytest.approx(7 * 0.5 / window)
    assert figures["rollout_idle_fraction"] == 0.25 and figures["staleness_max"] == 1.0


def test_analysis_reports_validation_time_without_subtracting_it():
    rows = _rows(2.0, 0.5, 9, 3)
    for row in rows[1:]:
        if "val/score/mean" in row:
            row["timing_s/validate"] = 5.0
    figures = e2e.analyse_run(rows, samples_per_step=16, warmup_steps=2)
    assert figures["validation_s"] == pytest.approx(15.0)
    assert figures["samples_per_s"] == pytest.approx(7 * 16 / (7 * 2.0 + 15.0))


def _run(eta: int, rep: int, rate: float, correction: str = "decoupled", score: float = 0.5):
    return {
        "eta": eta,
        "rep": rep,
        "correction": correction,
        "samples_per_s": rate,
        "final_val_score": score,
    }


def test_headline_is_the_median_paired_ratio_at_the_declared_eta_not_the_best():
    runs = [
        _run(0, 0, 10.0),
        _run(1, 0, 14.0),
        _run(4, 0, 18.0, score=0.6),
        _run(4, 0, 18.0, "bypass", score=0.4),
        _run(4, 1, 30.0, score=0.6),
        _run(1, 1, 15.0),
        _run(0, 1, 20.0),
        _run(0, 2, 10.0),
        _run(1, 2, 16.0),
        _run(4, 2, 12.0, score=0.6),
    ]
    summary = e2e.summarise(runs, (0, 1, 4), headline_eta=1)
    # η = 1 pairs: 14/10, 15/20, 16/10 -> median 1.4 (η = 4 pairs: 1.8, 1.5, 1.2 -> median 1.5)
    assert summary["headline_eta"] == 1 and summary["repetitions"] == 3
    assert summary["async_vs_sync"] == pytest.approx(1.4)
    assert summary["async_vs_sync_min"] == pytest.approx(0.75)
    assert summary["async_vs_sync_max"] == pytest.approx(1.6)
    assert summary["async_vs_sync_eta4"] == pytest.approx(1.5) and summary["best_eta"] == 4
    assert summary["val_score_bypass_eta4"] == 0.4
    assert summary["correction_score_gain"] == pytest.approx(0.2)
    assert summary["trainer_idle_eta1"] is None


def test_plan_alternates_the_order_every_repetition_with_one_bypass_run():
    assert e2e.run_plan((0, 1, 2), 3) == [
        (0, 0, "decoupled"),
        (0, 1, "decoupled"),
        (0, 2, "decoupled"),
        (0, 2, "bypass"),
        (1, 2, "decoupled"),
        (1, 1, "decoupled"),
        (1, 0, "decoupled"),
        (2, 0, "decoupled"),
        (2, 1, "decoupled"),
        (2, 2, "decoupled"),
    ]


def test_run_drives_alternated_repetitions_and_writes_e2e_json(tmp_path):
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
    assert seen == [
        (0, "decoupled"),
        (1, "decoupled"),
        (2, "decoupled"),
        (2, "bypass"),
        (2, "decoupled"),
        (1, "decoupled"),
        (0, "decoupled"),
    ]

    def rate(eta):
        rows = _rows(2.0 / (1 + eta), 0.1, TINY.total_steps, TINY.test_freq)
        figures = e2e.analyse_run(rows, samples_per_step=16, warmup_steps=TINY.warmup_steps)
        return figures["samples_per_s"]

    assert out["summary"]["async_vs_sync"] == pytest.approx(rate(2) / rate(0))
    assert out["summary"]["async_vs_sync_pairs"] == pytest.approx([rate(2) / rate(0)] * 2)
    assert out["summary"]["headline_eta"] == 2 and out["summary"]["best_eta"] == 2
    record = read_json(tmp_path / "e2e.json")
    assert record["status"] == "ok" and len(record["results"]["runs"]) == 7
    assert record["config"]["headline_eta"] == 2 and record["config"]["reps"] == 2
    assert record["results"]["long_tail"]["honoured"] is (
        0.5 * record["results"]["long_tail"]["requested_budget"]["mean"] <= 6.0
    )
    assert [row["x"] for row in record["sweep"]["rows"]] == [0, 1, 2]


def test_run_refuses_a_headline_eta_it_does_not_run(tmp_path):
    with pytest.raises(ValueError, match="headline_eta"):
        e2e.run(
            tmp_path, quick=True, etas=(0, 1), headline_eta=2, train_fn=lambda cfg: {}, sizes=TINY
        )


def test_run_refuses_etas_without_the_synchronous_baseline(tmp_path):
    with pytest.raises(ValueError, match="include 0"):
        e2e.run(tmp_path, quick=True, etas=(1, 2), train_fn=lambda cfg: {}, sizes=TINY)
