"""The `fleetrl train` command line of the e2e tests that run the CPU demo: a tiny policy,
briefly warm-started, and its data in the test's own folder; no validation, no checkpoints,
a fresh start. Each test adds the overrides it is about."""

from __future__ import annotations

import sys
from pathlib import Path


def demo_train_cmd(tmp: Path, run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_cpu.yaml",
        f"trainer.output_dir={run_dir}", f"trainer.total_steps={steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.resume=disable",
        f"model.path={tmp / 'model'}", "model.warmstart.steps=20",
        f"data.train_files=[{tmp / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp / 'data' / 'test.parquet'}]",
        *overrides,
    ]  # fmt: skip
