"""What a run leaves beside metrics.jsonl: validation samples in generations.jsonl and a wandb
table (read back from wandb's offline run files), and metrics, params and the config in MLflow
(read back through MLflow's own client), the same run again after a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config import LoggingConfig
from launcher.generations import WANDB_COLUMNS, read_generations
from launcher.tracking import Tracker
from rollout_fleet.validation import ValSample

CONFIG = {"learner": {"optim": {"lr": 3e-4, "betas": [0.9, 0.999]}}, "rollout": {"n": 4}}


def _sample(index: int, score: float) -> ValSample:
    return ValSample(
        index=index, data_source="synth/add", prompt=f"{index}+1=", response=str(index + 1),
        ground_truth=str(index + 1), score=score, response_length=2, finish_reason="stop",
        policy_version_min=3, policy_version_max=3, reward_metrics={"acc": score},
    )  # fmt: skip


def test_validation_samples_go_to_generations_jsonl_with_step_and_version(tmp_path):
    tracker = Tracker(LoggingConfig(), tmp_path, 4, CONFIG)
    tracker.log_generations(2, 2, [_sample(0, 1.0), _sample(5, 0.0)])
    tracker.log_generations(4, 4, [_sample(0, 1.0)])
    tracker.log_generations(5, 5, [])  # nothing kept: nothing written
    tracker.close()
    rows = read_generations(tmp_path / "generations.jsonl")
    assert [(r["step"], r["policy_version"], r["index"]) for r in rows] == [(2, 2, 0), (2, 2, 5), (4, 4, 0)]  # fmt: skip
    first = rows[0]
    assert (first["prompt"], first["response"], first["score"]) == ("0+1=", "1", 1.0)
    assert (first["data_source"], first["ground_truth"], first["finish_reason"]) == ("synth/add", "1", "stop")  # fmt: skip
    assert first["reward_metrics"] == {"acc": 1.0} and first["policy_version_min"] == 3


def test_mlflow_holds_the_metrics_params_and_config_and_a_resume_logs_into_the_same_run(
    tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg = LoggingConfig(mlflow=True, project="fleetrl-test", run_name="verl-demo")
    tracker = Tracker(cfg, tmp_path, 4, CONFIG)
    tracker.log(1, {"actor/pg_loss": 0.5, "val-core/synth/add/reward/mean@1": 0.25, "note": "text"})
    tracker.log(2, {"actor/pg_loss": 0.25})
    tracker.log_generations(2, 2, [_sample(0, 1.0)])
    tracker.close()
    again = Tracker(cfg, tmp_path, 4, CONFIG)  # the run resumes in the same run directory
    again.log(3, {"actor/pg_loss": 0.125})
    again.close()

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fleetrl-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "verl-demo" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert run.data.metrics["val-core/synth/add/reward/mean_at_1"] == 0.25  # verl's key rule
    assert run.data.params["learner.optim.lr"] == "0.0003"
    assert run.data.params["rollout.n"] == "4"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "generations"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "generations/step_2.json", str(tmp_path / "dl")))  # fmt: skip
    assert json.loads(local.read_text())[0]["response"] == "1"


@pytest.mark.timeout(300)
def test_wandb_gets_one_table_of_every_validations_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(LoggingConfig(wandb=True, project="fleetrl-test"), tmp_path, 4, CONFIG)
    tracker.log_generations(2, 2, [_sample(0, 1.0), _sample(5, 0.0)])
    tracker.log_generations(4, 4, [_sample(0, 0.0), _sample(5, 1.0)])
    tracker.close()
    tables = sorted(tmp_path.glob("wandb/offline-run-*/files/media/table/val/generations_*.table.json"))  # fmt: skip
    assert len(tables) == 2
    last = json.loads(max(tables, key=lambda p: p.stat().st_mtime).read_text())
    assert last["columns"] == list(WANDB_COLUMNS)
    assert [(row[0], row[2], row[7]) for row in last["data"]] == [(2, 0, 1.0), (2, 5, 0.0), (4, 0, 0.0), (4, 5, 1.0)]  # fmt: skip
