"""MLflow as a metrics sink of the run (``logging.mlflow``, verl's ``trainer.logger: mlflow``).

The tracking URI is ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a SQLite
store in the run directory (``<run dir>/mlflow.db``, artifacts in ``<run dir>/mlartifacts``).
The experiment is ``logging.project``, the run ``logging.run_name`` (``output_dir``'s name by
default); ``MLFLOW_RUN_ID`` attaches to a run made by the platform (as verl does). The run's
id is kept in ``<run dir>/mlflow_run.json``, so a resumed fleetrl run goes on logging into
the same MLflow run. Metrics go once per step in one batch; a key MLflow refuses is written
as verl writes it (``@`` becomes ``_at_``, other characters ``_``). The resolved config goes
as params (dotted keys) and as ``config.yaml``; validation samples as
``generations/step_<N>.json``.

Everything goes through one ``MlflowClient`` (no global ``mlflow.start_run`` state).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import yaml

from fleetrl.log import get_logger

log = get_logger(__name__)

RUN_FILE = "mlflow_run.json"
BATCH = 200  # entries per log_batch call (MLflow accepts 1000 metrics or 100 params)
PARAM_BATCH = 100
PARAM_VALUE_CHARS = 6000  # MLflow's limit on a param's value
_INVALID = re.compile(r"[^/\w.\- :]")


def metric_key(key: str) -> str:
    """``key`` as MLflow accepts it: verl's rule (``@`` -> ``_at_``, no repeated slashes)."""
    return re.sub(r"/+", "/", _INVALID.sub("_", key.replace("@", "_at_")))


def tracking_uri(run_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, key + "."))
        else:
            out[key] = json.dumps(value)[:PARAM_VALUE_CHARS] if not isinstance(value, str) else value[:PARAM_VALUE_CHARS]  # fmt: skip
    return out


class MlflowSink:
    def __init__(self, project: str, run_name: str, run_dir: Path, config: dict[str, Any]):
        from mlflow import MlflowClient

        self.uri = tracking_uri(run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id, resumed = self._run(project, run_name, run_dir)
        if not resumed:
            self._log_params(config)
            self.client.log_text(
                self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml"
            )
        log.info("MLflow: run %s at %s%s", self.run_id, self.uri, " (resumed)" if resumed else "")

    def _run(self, project: str, run_name: str, run_dir: Path) -> tuple[str, bool]:
        given = os.environ.get("MLFLOW_RUN_ID")
        if given:
            return given, False
        record = run_dir / RUN_FILE
        if record.is_file():
            saved = json.loads(record.read_text())
            if saved.get("tracking_uri") == self.uri:
                self.client.update_run(saved["run_id"], status="RUNNING")
                return saved["run_id"], True
        experiment = self.client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (run_dir / "mlartifacts").resolve().as_uri()  # fmt: skip
            experiment_id = self.client.create_experiment(project, artifact_location=artifacts)
        run = self.client.create_run(experiment_id, run_name=run_name)
        record.write_text(json.dumps({"tracking_uri": self.uri, "run_id": run.info.run_id}))
        return run.info.run_id, False

    def _log_params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten_params(config).items()]
        for start in range(0, len(params), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + PARAM_BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(metric_key(k), float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(entries), BATCH):
            self.client.log_batch(self.run_id, metrics=entries[start : start + BATCH])

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_text(
            self.run_id, json.dumps(rows, indent=1), f"generations/step_{step}.json"
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
