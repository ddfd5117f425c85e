"""``fleetrl bench reward`` runs both halves: the batched-vs-per-sample figures and, through
``bench.reward.run``'s default ``e2e`` hook, the e2e cost of model scoring; both land in the
suite's summary and its report, and a failing e2e half keeps the batched figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import cli, report, reward, reward_e2e
from bench.common import read_json

BATCHED = {
    "hidden": 64,
    "samples_per_s": {"batched": {"median": 300.0}, "per_sample": {"median": 150.0}},
    "paired_ratios": [1.9, 2.0, 2.1],
    "ratio": 2.0,
    "forwards_per_round": {"batched": [4, 4], "per_sample": [9, 9]},
    "scores_agree": True,
    "client_stats": {},
}


@pytest.fixture
def batched_half(monkeypatch):
    """The batched-vs-per-sample half replaced by fixed figures (its own server not started)."""
    monkeypatch.setattr(reward, "_measure_size", lambda hidden, *a: {**BATCHED, "hidden": hidden})


def test_bench_reward_reports_the_e2e_figures_of_the_served_half(
    tmp_path, monkeypatch, batched_half
):
    calls = []

    def run_served(out_dir, quick):
        calls.append((Path(out_dir), quick))
        return {"summary": {"model_vs_rule": 0.95, "model_scoring_overhead": 1 / 0.95 - 1,
                            "server_scored_items": 512}}  # fmt: skip

    monkeypatch.setattr(reward_e2e, "run_served", run_served)
    record = cli.run_suite("reward", tmp_path, quick=True, reps=2, flags={})
    assert calls == [(tmp_path, True)]  # the harness's call reached the e2e half
    assert record["status"] == "ok" and "missing_headlines" not in record
    summary = read_json(tmp_path / "reward.json")["summary"]
    assert summary["batched_vs_per_sample"] == 2.0 and summary["model_vs_rule"] == 0.95
    assert summary["server_scored_items"] == 512
    text = report.write_report(tmp_path)["report.md"].read_text()
    assert "| reward | `model_vs_rule` | 0.950 |" in text
    assert "| model_scoring_overhead | 0.053 |" in text


def test_a_failing_e2e_half_fails_the_suite_and_keeps_the_batched_figures(tmp_path, monkeypatch, batched_half):  # fmt: skip
    def run_served(out_dir, quick):
        raise TimeoutError("the reward server at http://127.0.0.1:1 did not start in 300 s")

    monkeypatch.setattr(reward_e2e, "run_served", run_served)
    record = cli.run_suite("reward", tmp_path, quick=True, reps=2, flags={})
    assert record["status"] == "error"
    assert "the e2e half failed: TimeoutError: the reward server" in record["error"]
    assert record["summary"]["batched_vs_per_sample"] == 2.0


def test_no_e2e_measures_batching_alone(tmp_path, monkeypatch, batched_half):
    monkeypatch.setattr(reward_e2e, "run_served", lambda *a: pytest.fail("e2e half ran"))
    out = reward.run(tmp_path, quick=True, reps=2, e2e=None)
    assert out["summary"]["batched_vs_per_sample"] == 2.0 and "model_vs_rule" not in out["summary"]
