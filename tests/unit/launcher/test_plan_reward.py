"""`fleetrl plan` with a reward fleet: the reward server's weights are the classifier's own
parameters, the row and verdict appear only when the run places reward servers, and an
SGLang reward server that cannot hold its weights fails the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config import load_run_config
from launcher.plan import render, reward_plan
from learner.memory import GB, ModelShape

REPO = Path(__file__).resolve().parents[3]
QWEN_7B_JSON = REPO / "configs/models/Qwen2.5-7B-Instruct.config.json"


def test_reward_weights_are_the_classifiers_parameters(tiny_reward_dir):
    from fleetrl.models.loading import load_sequence_classifier

    cfg = load_run_config(None, [f"reward.model.path={tiny_reward_dir}"])
    plan = reward_plan(cfg, 80.0)
    params = sum(p.numel() for p in load_sequence_classifier(tiny_reward_dir).parameters())
    assert plan.weights_gb * GB == pytest.approx(params * 4)  # float32
    assert plan.backend == "embedded" and plan.static_gb == 0 and plan.forward_gb > 0


def test_the_reward_row_shows_only_for_a_placed_fleet(tiny_reward_dir, tiny_model_dir):
    policy = f"model.path={tiny_model_dir}"
    placed = load_run_config(None, [policy, f"reward.model.path={tiny_reward_dir}"])
    text, fits = render(placed, 80.0)
    assert fits and "| reward server (TP 1) |" in text and "reward servers on CPU" in text
    remote = load_run_config(None, [policy, f"reward.model.path={tiny_reward_dir}", "reward.model.urls=[http://h:1]"])  # fmt: skip
    assert "reward server" not in render(remote, 80.0)[0]
    assert reward_plan(load_run_config(None, []), 80.0) is None


def test_an_sglang_reward_server_must_hold_its_weights_in_the_static_pool(tmp_path):
    rm = tmp_path / "rm7b"
    rm.mkdir()
    config = json.loads(QWEN_7B_JSON.read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (rm / "config.json").write_text(json.dumps(config))
    overrides = [f"reward.model.path={rm}", "reward.model.backend=sglang", "model.dtype=bfloat16",
                 "reward.model.gpus_per_engine=1", "reward.model.batch_size=8",
                 "reward.model.max_length=2048"]  # fmt: skip
    cfg = load_run_config(None, overrides)
    plan = reward_plan(cfg, 80.0)
    shape = ModelShape.from_config_dict(config)
    assert plan.weights_gb == pytest.approx(shape.params(lm_head=False) * 2 / GB)
    assert 13 < plan.weights_gb < 15 and plan.static_gb == pytest.approx(0.85 * 80)
    text, _ = render(cfg, 80.0, str(QWEN_7B_JSON))
    assert "reward server device: SGLang reserves" in text
    assert "forward" in text and "DOES NOT FIT" not in text.split("reward server device")[1]
    text_small, fits_small = render(cfg, 16.0, str(QWEN_7B_JSON))
    assert not fits_small and "DOES NOT FIT" in text_small.split("reward server device")[1]
