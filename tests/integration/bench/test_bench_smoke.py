"""Smoke: each bench suite runs at its smallest size and writes its JSON, the table and plots.

Not timed: a benchmark is never a test (figures are only checked to exist and be
finite). A suite whose module has not been written yet is skipped by name; one
that exists must finish with ``status: ok`` and every headline ratio present.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import requests

from bench import accuracy, cli, e2e, reward_e2e
from bench.common import read_json
from bench.report import HEADLINES, write_report

PEER_SUITES = ["transport", "weight-sync", "rollout", "learner", "reward"]
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


def _classifying_train(seen: list):
    """A stand-in for the training loop that, in the model arm, scores one input on the
    reward server it is pointed at (the server the reward suite started) and runs 20 %
    slower; the rule arm touches no server."""

    def train(cfg):
        urls = list(cfg.reward.model.urls)
        if urls:
            key = cfg.reward.model.api_key(os.environ)  # the server's, as the run reads it
            reply = requests.post(
                urls[0] + "/classify",
                json={"input_ids": [[7, 8, 9]]},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            reply.raise_for_status()
            seen.append(reply.json()[0]["embedding"][0])
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True)
        step_s = 1.2 if urls else 1.0
        rows = [
            {"step": step, "timing_s/step": step_s, "time/elapsed_s": step * step_s}
            for step in range(1, cfg.trainer.total_steps + 1)
        ]
        path = run_dir / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"metrics_path": str(path), "run_dir": str(run_dir)}

    return train


@pytest.mark.parametrize("suite", PEER_SUITES)
def test_suite_runs_at_its_smallest_size_and_reports_its_headline_ratios(suite, tmp_path, monkeypatch):  # fmt: skip
    _require_module(suite)
    scored: list[float] = []
    if suite == "reward":  # its e2e half trains: scripted here, on the real server it starts
        tiny = dataclasses.replace(
            e2e.QUICK_SIZES, total_steps=4, warmup_steps=1, test_freq=2, train_size=16,
            val_size=4, hidden=32, layers=1, warmstart_steps=0,
        )  # fmt: skip
        monkeypatch.setattr(reward_e2e, "QUICK_SIZES", tiny)
        monkeypatch.setattr(e2e, "default_train_fn", lambda: _classifying_train(scored))
    record = cli.run_suite(suite, tmp_path, quick=True, reps=1, flags=SMALLEST_FLAGS)
    _assert_headlines(record, suite)
    assert read_json(tmp_path / f"{suite}.json")["suite"] == suite
    written = write_report(tmp_path)
    assert f"| {suite} |" in written["report.md"].read_text()
    if suite == "reward":
        summary = record["summary"]
        assert len(scored) == 2 and all(math.isfinite(v) for v in scored)  # 2 model-arm runs
        assert summary["model_vs_rule"] == pytest.approx(1 / 1.2)
        assert summary["server_scored_items"] == 2  # the scripted runs' inputs, on that server
        url = read_json(tmp_path / "reward_e2e.json")["config"]["reward_urls"][0]
        with pytest.raises(requests.ConnectionError):  # stopped after the runs
            requests.get(url + "/health", timeout=5)


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


def _accuracy_sizes(seeds: tuple[int, ...]) -> accuracy.AccuracySizes:
    workload = dataclasses.replace(
        accuracy.QUICK_SIZES.workload,
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
    return accuracy.AccuracySizes(workload=workload, target_score=0.5, seeds=seeds)


def _scripted_train(cfg):
    """A stand-in for the training loop: metrics.jsonl, and snapshot scores (scores.json)
    that rise faster at larger η; the run validates nothing, as the suite asks."""
    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True)
    assert cfg.trainer.test_freq == -1 and cfg.trainer.save_hf_freq == 2
    eta, seed = cfg.buffer.max_staleness, cfg.trainer.seed
    rows, scores = [], {0: 0.2}
    for step in range(1, cfg.trainer.total_steps + 1):
        rows.append(
            {"step": step, "timing_s/step": 1 / (1 + eta), "time/elapsed_s": step / (1 + eta) + 0.5}
        )
        if step % cfg.trainer.save_hf_freq == 0:
            scores[step] = 0.2 + 0.1 * step + 0.01 * seed
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "scores.json").write_text(json.dumps(scores))
    return {"metrics_path": str(path), "run_dir": str(run_dir)}


def _scripted_scores(run_dir: Path) -> dict[int, float]:
    return {int(step): score for step, score in read_json(run_dir / "scores.json").items()}


def test_accuracy_grid_reports_curves_seed_statistics_headlines_and_plot(tmp_path):
    sizes = _accuracy_sizes((0, 1))
    sizes = dataclasses.replace(  # the scripted loop needs no trained model
        sizes, workload=dataclasses.replace(sizes.workload, warmstart_steps=0)
    )
    out = accuracy.run(
        tmp_path, etas=(0, 4, 8), sizes=sizes, train_fn=_scripted_train, score_fn=_scripted_scores
    )
    record = read_json(tmp_path / "accuracy.json")
    _assert_headlines(record, "accuracy")
    runs = record["results"]["runs"]
    assert len(runs) == 8 and {(r["eta"], r["correction"]) for r in runs} == {
        (0, "decoupled"),
        (4, "decoupled"),
        (8, "decoupled"),
        (8, "bypass"),
    }
    assert [p["step"] for p in runs[0]["curve"]] == [0, 2, 4]
    summary = out["summary"]
    assert summary["time_to_target_vs_sync"] == pytest.approx(5.0)  # 4.0 s vs 0.8 s
    assert summary["final_gap_eta4"] == pytest.approx(0.0)
    assert summary["correction_gain_eta8"] == pytest.approx(0.0)
    assert summary["final_score_std_eta0"] == pytest.approx(0.01 / 2**0.5)
    written = write_report(tmp_path)
    assert "accuracy_score.png" in written
    assert "| eta8_bypass |" in written["report.md"].read_text()


@pytest.mark.slow
def test_accuracy_trains_sync_and_async_at_its_smallest_size(tmp_path):
    out = accuracy.run(tmp_path, quick=True, etas=(0, 1), sizes=_accuracy_sizes((0,)), bypass_eta=1)
    runs = out["results"]["runs"]
    assert [(r["eta"], r["correction"]) for r in runs] == [
        (0, "decoupled"),
        (1, "decoupled"),
        (1, "bypass"),
    ]
    for run in runs:
        assert [p["step"] for p in run["curve"]] == [0, 2, 4]
        assert all(0.0 <= p["score"] <= 1.0 and p["wall_s"] >= 0.0 for p in run["curve"])
    assert set(out["results"]["settings"]) == {"eta0", "eta1", "eta1_bypass"}


def test_accuracy_size_flags_reach_every_run(tmp_path):
    """``fleetrl bench accuracy --device ... --engines ... --batch ...`` sizes the runs the
    way the e2e suite's flags do (here on CPU; on a GPU the same flags say cuda)."""
    seen: list[tuple[str, int, int]] = []
    seen_tokens: list[int] = []

    def recording_train(cfg):
        seen.append((cfg.trainer.device, cfg.rollout.num_engines, cfg.data.train_batch_size))
        seen_tokens.append(cfg.rollout.max_new_tokens)
        return _scripted_train(cfg)

    sizes = _accuracy_sizes((0,))
    sizes = dataclasses.replace(
        sizes, workload=dataclasses.replace(sizes.workload, warmstart_steps=0)
    )
    accuracy.run(
        tmp_path, etas=(0, 4), bypass_eta=None, sizes=sizes, train_fn=recording_train,
        score_fn=_scripted_scores, device="cpu", engines=2, batch=3, max_new_tokens=6,
    )  # fmt: skip
    assert seen == [("cpu", 2, 3), ("cpu", 2, 3)] and seen_tokens == [6, 6]
    record = read_json(tmp_path / "accuracy.json")
    assert record["config"]["sizes"]["engines"] == 2
