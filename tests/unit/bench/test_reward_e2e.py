"""bench.reward_e2e driven by a fake trainer: the arms alternate, the model arm scores on the
given servers with the model's weight 0 (the same policy learns in both), and the headline
is the paired samples/s ratio with the overhead it implies."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import e2e, reward_e2e
from bench.common import read_json
from tests.unit.bench.test_e2e_analysis import TINY, _rows

URLS = ["http://127.0.0.1:30010", "http://127.0.0.1:30011"]


def test_the_plan_alternates_which_arm_runs_first():
    assert reward_e2e.run_plan(3) == [
        (0, "rule"), (0, "model"), (1, "model"), (1, "rule"), (2, "rule"), (2, "model"),
    ]  # fmt: skip


def test_run_alternates_the_arms_and_reports_the_paired_cost_of_model_scoring(tmp_path):
    seen = []

    def fake_train(cfg):
        model = cfg.reward.model
        arm = "model" if model.urls else "rule"
        seen.append(arm)
        if arm == "model":
            assert model.urls == URLS and model.weight == 0.0 and cfg.reward.rule_weight == 1.0
            assert (Path(model.path) / "config.json").is_file()  # the tiny reward model built
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True)
        rows = _rows(1.0 if arm == "rule" else 1.05, 0.1, cfg.trainer.total_steps, cfg.trainer.test_freq)  # fmt: skip
        if arm == "model":
            for row in rows:
                row["reward/group_latency_s/mean"] = 0.02
                row["reward/model_failed"] = 0.0
        metrics = run_dir / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"run_dir": str(run_dir), "metrics_path": str(metrics)}

    out = reward_e2e.run(tmp_path, reward_urls=URLS, reps=2, sizes=TINY, train_fn=fake_train)
    assert seen == ["rule", "model", "model", "rule"]

    def rate(step_s):
        rows = _rows(step_s, 0.1, TINY.total_steps, TINY.test_freq)
        return e2e.analyse_run(rows, samples_per_step=16, warmup_steps=TINY.warmup_steps)[
            "samples_per_s"
        ]

    expected = rate(1.05) / rate(1.0)
    summary = out["summary"]
    assert summary["model_vs_rule"] == pytest.approx(expected)
    assert summary["model_vs_rule_pairs"] == pytest.approx([expected, expected])
    assert summary["model_scoring_overhead"] == pytest.approx(1 / expected - 1)
    assert summary["group_latency_s"] == 0.02
    record = read_json(tmp_path / "reward_e2e.json")
    assert record["status"] == "ok" and record["config"]["reward_urls"] == URLS
    assert len(record["results"]["runs"]) == 4


def test_run_needs_the_reward_servers(tmp_path):
    with pytest.raises(ValueError, match="reward servers' URLs"):
        reward_e2e.run(tmp_path, reward_urls=[], sizes=TINY, train_fn=lambda cfg: {})


class _FakeServer:
    """A stand-in for bench.reward_server.RewardServer: records its life, serves nothing."""

    made: list[_FakeServer] = []

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.url = f"http://127.0.0.1:{30100 + len(self.made)}"
        self.api_key = f"key-{len(self.made)}"
        self.waited = self.stopped = False
        self.made.append(self)

    def wait(self) -> _FakeServer:
        self.waited = True
        return self

    def info(self) -> dict:
        return {"scored_requests": 7, "scored_items": 28}

    def __enter__(self) -> _FakeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stopped = True


def _scripted_train(seen: list):
    def train(cfg):
        model = cfg.reward.model
        seen.append((list(model.urls), model.path, model.api_key(os.environ)))
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True)
        rows = _rows(1.0 if not model.urls else 1.2, 0.1, cfg.trainer.total_steps, cfg.trainer.test_freq)  # fmt: skip
        metrics = run_dir / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"run_dir": str(run_dir), "metrics_path": str(metrics)}

    return train


def test_run_served_scores_the_model_arm_on_the_server_it_started_then_stops_it(tmp_path):
    _FakeServer.made.clear()
    seen: list = []
    out = reward_e2e.run_served(
        tmp_path, reps=1, sizes=TINY, train_fn=_scripted_train(seen), server_factory=_FakeServer
    )
    [server] = _FakeServer.made
    assert server.waited and server.stopped
    # the server serves the reward model built on the workload's policy, and only the model
    # arm is pointed at it
    assert (server.model_dir / "config.json").is_file()
    # the runs send the key the server was started with (reward.model.api_key_env)
    assert seen == [([], "", server.api_key), ([server.url], str(server.model_dir), server.api_key)]
    assert os.environ.get("FLEETRL_API_KEY") != server.api_key  # set only while they ran
    summary = out["summary"]
    assert summary["server_scored_items"] == 28 and summary["server_scored_requests"] == 7
    assert summary["model_vs_rule"] < 1.0 < 1.0 + summary["model_scoring_overhead"]
    record = read_json(tmp_path / "reward_e2e.json")
    assert record["status"] == "ok" and record["config"]["reward_urls"] == [server.url]
    assert record["summary"]["server_scored_items"] == 28


def test_run_served_stops_its_server_when_a_run_fails(tmp_path):
    _FakeServer.made.clear()

    def failing_train(cfg):
        raise RuntimeError("the trainer broke")

    with pytest.raises(RuntimeError, match="the trainer broke"):
        reward_e2e.run_served(tmp_path, reps=1, sizes=TINY, train_fn=failing_train, server_factory=_FakeServer)  # fmt: skip
    assert [s.stopped for s in _FakeServer.made] == [True]
