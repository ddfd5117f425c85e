"""A verl config on the CPU demo: what a verl run shows, read back as a user would.

The demo task (addition, a tiny model) written in verl's layout, with the CPU parts in its
`fleetrl:` section. Three steps with `trainer.log_val_generations`, `global_profiler.steps`
and `trainer.logger: [console, mlflow]`: the validation samples are read from
generations.jsonl, the profile is Chrome-trace JSON with the learner's stages and the
engine's forward passes, and MLflow holds the metrics (verl's names) and the config, read
through MLflow's own client. Then `trainer.resume_mode: resume_path` starts a new run from
the first run's step-2 checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}  # fmt: skip
SAMPLES = 4


def verl_demo(tmp_path: Path, run_dir: Path) -> dict:
    data = tmp_path / "data"
    return {
        "data": {
            "train_files": str(data / "train.parquet"), "val_files": str(data / "test.parquet"),
            "train_batch_size": 8, "max_prompt_length": 60, "val_max_samples": 16,
            "filter_overlong_prompts": True,
        },
        "actor_rollout_ref": {
            "model": {"path": str(tmp_path / "model"), "enable_gradient_checkpointing": False},
            "actor": {"optim": {"lr": 3e-4}, "ppo_mini_batch_size": 8, "use_dynamic_bsz": True,
                      "fsdp_config": {"dtype": "float32"}},
            "rollout": {"name": "sglang", "n": 4, "response_length": 4, "dtype": "float32",
                        "tensor_model_parallel_size": 1},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "device": "cpu", "total_training_steps": 3, "save_freq": 2, "test_freq": 2,
            "log_val_generations": SAMPLES, "logger": ["console", "mlflow"],
            "project_name": "fleetrl-e2e", "experiment_name": "verl-demo",
            "default_local_dir": str(run_dir),
        },
        "global_profiler": {"tool": "torch", "steps": [2]},
        "fleetrl": {
            "data": {"synth_task": "add2", "synth_train_size": 200, "synth_test_size": 40},
            "model": {"create_tiny": True, "tiny": {"max_positions": 64},
                      "warmstart": {"steps": 30, "label_noise": 0.8}},
            "rollout": {"backend": "embedded"},
        },
    }  # fmt: skip


def train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher.cli", "train", "--config", str(config), *overrides]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_verl_config_runs_and_leaves_generations_profiles_and_mlflow_runs(tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "verl_demo.yaml"
    config.write_text(yaml.safe_dump(verl_demo(tmp_path, run_dir), sort_keys=False))
    proc = train(config)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "verl config: trainer.device=cpu" in proc.stderr  # the notes, named once

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # no timing_s/old_log_prob: with one optimizer step per batch π_prox is the update's own
    # forward (learner/proximal.py), so no separate pass is timed
    for key in ("timing_s/gen", "timing_s/update_actor", "timing_s/adv",
                "timing_s/update_weights", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac",
                "actor/grad_norm", "critic/score/mean", "critic/rewards/mean",
                "critic/advantages/mean", "response_length/mean", "perf/total_num_tokens",
                "perf/throughput", "training/global_step"):  # fmt: skip
        assert all(key in r for r in steps), key
    # verl's names: the scorer returns acc, so acc is the core variable, the reward aux
    assert any(
        "val-core/synth/add2/acc/mean@1" in r and "val-aux/synth/add2/reward/mean@1" in r
        for r in records
    )
    assert all(r["staleness/max"] == 0 for r in steps)  # verl's trainer is synchronous

    # trainer.log_val_generations: before training and at steps 2 and 3, the same prompts
    generations = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]  # fmt: skip
    by_step: dict[int, list[dict]] = {}
    for row in generations:
        by_step.setdefault(row["step"], []).append(row)
    assert sorted(by_step) == [0, 2, 3] and all(len(rows) == SAMPLES for rows in by_step.values())
    assert len({tuple(r["index"] for r in rows) for rows in by_step.values()}) == 1
    for row in generations:
        assert "=" in row["prompt"] and row["reward_metrics"]["acc"] == row["score"]
        assert row["data_source"] == "synth/add2" and row["ground_truth"]
        assert row["score"] in (0.0, 1.0) and 1 <= row["response_length"] <= 4
        assert row["policy_version_min"] == row["policy_version"] == row["step"]

    # global_profiler.steps: a Chrome trace of step 2 from the learner rank and the engine
    learner = json.loads((run_dir / "profile/step_2/learner_rank0.json").read_text())
    names = {event.get("name", "") for event in learner["traceEvents"]}
    assert {"learner/update_actor", "learner/adv"} <= names
    assert "learner/old_log_prob" not in names  # π_prox is the update's own forward
    assert any(name.startswith("aten::") for name in names)
    (engine_trace,) = (run_dir / "profile/step_2").glob("engine_*.json")
    engine_names = {event.get("name", "") for event in json.loads(engine_trace.read_text())["traceEvents"]}  # fmt: skip
    assert any(name.startswith("aten::") for name in engine_names)
    assert not (run_dir / "profile/step_1").exists()

    # trainer.logger mlflow: a SQLite store in the run directory, read by MLflow's client
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fleetrl-e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "verl-demo"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [m.step for m in history] == [1, 2, 3]
    assert "val-core/synth/add2/acc/mean_at_1" in run.data.metrics
    assert run.data.params["learner.optim.lr"] == "0.0003"
    assert run.data.params["buffer.max_staleness"] == "0"

    # trainer.resume_mode=resume_path: a new run directory, from the first run's step 2
    second = tmp_path / "second"
    resumed = train(
        config,
        f"trainer.default_local_dir={second}",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={run_dir / 'checkpoints' / 'step_2'}",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    later = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in later if "actor/pg_loss" in r]
    assert [r["step"] for r in trained] == [3]  # steps 1-2 came from the checkpoint
    assert trained[0]["policy_version"] == 3
    assert (second / "checkpoints" / "step_3").is_dir()
