"""bench.e2e_placement without Ray: the alternated plan, the paired ratio at the declared η,
and the switch's share of a co-located step, driven by a fake trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import e2e, e2e_placement
from bench.common import read_json
from bench.report import suite_headlines
from tests.unit.bench.test_e2e_analysis import TINY, _rows

SWITCH = {  # seconds of one co-located step's switch, by part
    "colocate/release_s": 0.05,
    "colocate/onload_s": 0.0,
    "colocate/resume_weights_s": 0.01,
    "colocate/push_s": 0.1,
    "colocate/resume_kv_s": 0.02,
    "colocate/offload_s": 0.0,
}


def test_the_plan_pairs_each_eta_and_reverses_the_order_every_repetition():
    plan = e2e_placement.run_plan((0, 2), reps=2)
    first = [(eta, p) for rep, eta, p in plan if rep == 0]
    second = [(eta, p) for rep, eta, p in plan if rep == 1]
    assert first == [(0, "disaggregated"), (0, "colocated"), (2, "disaggregated"), (2, "colocated")]
    assert second == list(reversed(first))


def test_the_suite_reports_the_paired_ratio_and_the_switch_share(tmp_path):
    seen: list[tuple[int, str]] = []

    def fake_train(cfg):
        eta, placement = cfg.buffer.max_staleness, cfg.rollout.placement
        seen.append((eta, placement))
        step_s = (2.0 if placement == "colocated" else 1.0) / (1 + eta)
        rows = _rows(step_s, 0.1, cfg.trainer.total_steps, cfg.trainer.test_freq)
        if placement == "colocated":
            for row in rows:
                if "timing_s/step" in row:
                    row.update(SWITCH, **{"colocate/bytes_released": 1000.0})
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True)
        metrics = run_dir / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"run_dir": str(run_dir), "metrics_path": str(metrics)}

    out = e2e.run(
        tmp_path, quick=True, placement="colocated", headline_eta=2, train_fn=fake_train, sizes=TINY
    )
    assert seen[:4] == [
        (0, "disaggregated"),
        (0, "colocated"),
        (2, "disaggregated"),
        (2, "colocated"),
    ]
    assert len(seen) == 8
    summary = out["summary"]

    def rate(step_s: float) -> float:
        rows = _rows(step_s, 0.1, TINY.total_steps, TINY.test_freq)
        return e2e.analyse_run(rows, samples_per_step=16, warmup_steps=TINY.warmup_steps)[
            "samples_per_s"
        ]

    assert summary["colocated_vs_disaggregated"] == pytest.approx(rate(2 / 3) / rate(1 / 3))
    assert summary["colocated_vs_disaggregated_pairs"] == pytest.approx(
        [rate(2 / 3) / rate(1 / 3)] * 2
    )
    switch_s = sum(SWITCH.values())
    assert summary["switch_s"] == pytest.approx(switch_s)
    step_s = [r["timing_s/step"] for r in _rows(2 / 3, 0.1, 6, 3) if "timing_s/step" in r]
    shares = sorted(switch_s / s for s in step_s[TINY.warmup_steps :])
    assert min(shares) <= summary["switch_share"] <= max(shares)
    assert summary["bytes_released"] == 1000.0
    record = read_json(tmp_path / "e2e.json")
    assert record["config"]["placement"] == "colocated"
    assert [k for k, _, _ in suite_headlines("e2e", record)] == [
        "colocated_vs_disaggregated",
        "switch_share",
    ]
