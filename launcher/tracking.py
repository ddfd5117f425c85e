"""Run tracking: metrics.jsonl (always), console progress, wandb, TensorBoard and MLflow
(optional), validation samples.

One ``Tracker`` per run, owned by the driver. ``log(step, metrics)`` appends one
JSON object per step (with ``step`` and ``policy_version``) to
``<run dir>/metrics.jsonl``, forwards to wandb (respecting ``WANDB_MODE``;
offline works with no network), TensorBoard and MLflow (launcher/mlflow_sink.py) when
enabled, and prints a progress line every ``console_every`` steps (step, score,
staleness, throughput, ETA) through the logger. ``log_generations(step, version,
samples)`` writes validation samples to ``<run dir>/generations.jsonl``, a wandb table
and MLflow (launcher/generations.py).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger
from launcher.config import LoggingConfig
from launcher.generations import WANDB_COLUMNS, WANDB_KEY, GenerationLog
from rollout_fleet.validation import ValSample

log = get_logger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Tracker:
    def __init__(
        self, cfg: LoggingConfig, run_dir: Path, total_steps: int, config_dict: dict[str, Any]
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.metrics_path = run_dir / "metrics.jsonl"
        self._file = self.metrics_path.open("a", buffering=1)
        self._start = time.monotonic()
        self._first_step: int | None = None
        self._wandb = None
        self._tb = None
        if cfg.wandb:
            import wandb

            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.run_name or run_dir.name,
                dir=str(run_dir),
                config=config_dict,
                resume="allow",
            )
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._mlflow = None
        if cfg.mlflow:
            from launcher.mlflow_sink import MlflowSink

            self._mlflow = MlflowSink(cfg.project, cfg.run_name or run_dir.name, run_dir, config_dict)  # fmt: skip
        self.generations = GenerationLog(run_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        numeric = {
            k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)
        }
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._mlflow is not None:
            self._mlflow.log(step, numeric)
        if self._first_step is None:
            self._first_step = step
        if step % self.cfg.console_every == 0 or step == self.total_steps:
            self._console(step, metrics)

    def _console(self, step: int, m: dict[str, Any]) -> None:
        done = step - (self._first_step or 0) + 1
        elapsed = time.monotonic() - self._start
        eta = elapsed / max(done, 1) * max(self.total_steps - step, 0)
        parts = [f"step {step}/{self.total_steps}"]
        if "policy_version" in m:
            parts.append(f"v{m['policy_version']}")
        for key, label, fmt in (
            ("critic/score/mean", "score", "{:.3f}"),
            ("train/loss", "loss", "{:.4f}"),  # reward-model runs (fleetrl rm train)
            ("train/acc", "acc", "{:.3f}"),
            ("val/accuracy", "val acc", "{:.3f}"),
            ("val/score/mean", "val", "{:.3f}"),
            ("staleness/mean", "stale", "{:.2f}"),
            ("staleness/max", "max", "{:.0f}"),
            ("perf/throughput", "tok/s", "{:.0f}"),
            ("perf/tokens_per_s", "tok/s", "{:.0f}"),
            ("actor/pg_loss", "pg", "{:+.4f}"),
        ):
            if isinstance(m.get(key), int | float):
                parts.append(f"{label} {fmt.format(m[key])}")
        parts.append(f"ETA {eta:.0f}s")
        log.info(" | ".join(parts))

    def log_generations(self, step: int, policy_version: int, samples: list[ValSample]) -> None:
        """Validation samples (``trainer.log_val_generations``): the file, wandb, MLflow."""
        if not samples:
            return
        rows = self.generations.write(step, policy_version, samples)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(WANDB_COLUMNS), data=self.generations.table_rows)
            self._wandb.log({WANDB_KEY: table}, step=step)
        if self._mlflow is not None:
            self._mlflow.log_generations(step, rows)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        if self._mlflow is not None:
            self._mlflow.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
