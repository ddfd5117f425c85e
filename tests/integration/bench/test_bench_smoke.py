"""Smoke: each bench suite runs at its smallest size and writes its JSON, the table and plots.

Not timed: a benchmark is never a test (figures are only checked to exist and be
finite). A suite whose module has not been written yet is skipped by name; one
that exists must finish with ``status: ok`` and every headline ratio present.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest

from bench import cli, e2e
from bench.common import read_json
from bench.report import HEADLINES, write_report

PEER_SUITES = ["transport", "weight-sync", "rollout", "learner"]
# the smallest sizes each suite accepts through the harness
SMALLEST_FLAGS = {"hidden": [32], "layers": 1, "batch": 2, "max_new_tokens": 4}


def _require_module(suite: str) -> None:
    module = cli.SUITE_MODULES[suite]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not written yet")


def _assert_headlines(record: dict, suite: str) -> None:
    assert record["status"] == "ok", record.get("error")
    for key, _, _ in HEADLINES[suite]:
        value = record["summary"].get(key)
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (key, value)


@pytest.mark.parametrize("suite", PEER_SUITES)
def test_suite_runs_at_its_smallest_size_and_reports_its_headline_ratios(suite, tmp_path):
    _require_module(suite)
    record = cli.run_suite(suite, tmp_path, quick=True, reps=1, flags=SMALLEST_FLAGS)
    _assert_headlines(record, suite)
    assert read_json(tmp_path / f"{suite}.json")["suite"] == suite
    written = write_report(tmp_path)
    assert f"| {suite} |" in written["report.md"].read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)  # three training runs; on a shared 2-core machine they take minutes
def test_e2e_trains_sync_and_async_and_writes_scores_idle_fractions_and_plots(tmp_path):
    sizes = dataclasses.replace(
        e2e.QUICK_SIZES,
        total_steps=4,
        warmup_steps=1,
        test_freq=2,
        train_batch_size=2,
        group_size=2,
        max_new_tokens=8,
        train_size=40,
        val_size=4,
        hidden=32,
        warmstart_steps=20,
    )
    out = e2e.run(tmp_path, quick=True, reps=1, etas=(0, 1), headline_eta=1, sizes=sizes)
    record = read_json(tmp_path / "e2e.json")
    _assert_headlines(record, "e2e")
    assert [(r["eta"], r["correction"]) for r in record["results"]["runs"]] == [
        (0, "decoupled"),
        (1, "decoupled"),
        (1, "bypass"),
    ]
    for eta in (0, 1):
        assert out["summary"][f"val_score_eta{eta}"] is not None
        assert 0.0 <= out["summary"][f"trainer_idle_eta{eta}"] <= 1.0
        assert 0.0 <= out["summary"][f"rollout_idle_eta{eta}"] <= 1.0
    assert out["summary"]["val_score_bypass_eta1"] is not None
    written = write_report(tmp_path)
    assert {"e2e_score.png", "e2e_throughput.png", "summary.png"} <= set(written)
