"""A run folder belongs to its run: `fleetrl train` into another run's folder refuses before
Ray starts and leaves it byte-identical; keys that do not change the run do not count; a
finished run says "already at step N of N" and exits 0 without Ray; `--resume-with-changes`
continues on purpose and keeps the earlier config.yaml.

The CLI tests put a `ray` package that raises on import first on the path: they fail if
the command so much as imports Ray.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import yaml

from fleetrl.config import to_dict
from fleetrl.data.schema import write_rows
from launcher.config import load_run_config
from launcher.run_folder import (
    differing_keys,
    finished_line,
    folder_findings,
    read_folder,
    write_config,
)
from tests.unit.launcher.test_preflight_data import ROW, model_folder, no_ray
from tests.unit.learner.test_checkpoint_discovery import fake_checkpoint

REPO = Path(__file__).resolve().parents[3]


def overrides(tmp_path: Path, *more: str) -> list[str]:
    data = tmp_path / "data.parquet"
    if not data.exists():
        write_rows([ROW], data)
    model = tmp_path / "model"
    if not model.exists():
        model_folder(model)
    return [
        f"data.train_files=[{data}]", "data.val_files=[]", f"model.path={model}",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=40", *more,
    ]  # fmt: skip


def earlier_run(tmp_path: Path, *keys: str, step: int = 20) -> Path:
    """A folder as a run leaves it: its config.yaml, a checkpoint, metrics, a bank segment."""
    cfg = load_run_config(None, overrides(tmp_path, *keys))
    run = Path(cfg.trainer.output_dir)
    run.mkdir()
    write_config(run, cfg)
    fake_checkpoint(run / "checkpoints", step, world=1)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "rollout_bank").mkdir()
    (run / "rollout_bank" / "segment_000000.arrow").write_bytes(b"trajectories")
    return run


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{no_ray(tmp_path)}{os.pathsep}{REPO}"
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_train_into_another_runs_folder_refuses_and_leaves_it_byte_identical(tmp_path):
    run = earlier_run(tmp_path, "learner.optim.lr=1e-5")
    before = digest(run)
    proc = cli(tmp_path, "train", *overrides(tmp_path, "learner.optim.lr=3e-4", "rollout.n=2"))
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"fleetrl: preflight error at trainer.output_dir: {run} holds another run")  # fmt: skip
    assert "learner.optim.lr (1e-05 -> 0.0003), rollout.n (4 -> 2)" in line
    assert "--resume-with-changes" in line
    assert digest(run) == before


def test_keys_that_do_not_change_the_run_do_not_count(tmp_path):
    run = earlier_run(tmp_path)
    old = yaml.safe_load((run / "config.yaml").read_text())
    cfg = load_run_config(
        None,
        overrides(tmp_path, "trainer.total_steps=80", "logging.console_every=1", "ray.num_cpus=2",
                  "trainer.test_freq=5", "reward.max_failed_groups=0"),
    )  # fmt: skip
    assert differing_keys(old, cfg) == []
    assert folder_findings(cfg, read_folder(cfg), resume_with_changes=False) == []
    del old["learner"]["optim"]["lr"]  # written by an earlier fleetrl: the default stands in
    assert differing_keys(old, cfg) == []
    assert differing_keys(old, load_run_config(None, overrides(tmp_path, "learner.optim.lr=0.5"))) == ["learner.optim.lr"]  # fmt: skip


def test_a_finished_run_says_so_and_exits_0_without_ray(tmp_path):
    run = earlier_run(tmp_path, step=40)
    before = digest(run)
    proc = cli(tmp_path, "train", *overrides(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"fleetrl train: {run} is already at step 40 of 40: nothing to train (raise "
        "trainer.total_steps to go on, or choose another trainer.output_dir)"
    )
    assert digest(run) == before
    longer = load_run_config(None, overrides(tmp_path, "trainer.total_steps=60"))
    assert finished_line(longer, read_folder(longer)) is None  # raised to go on: it trains


def test_resume_with_changes_continues_and_keeps_the_earlier_config(tmp_path):
    run = earlier_run(tmp_path, "learner.optim.lr=1e-5")
    old_text = (run / "config.yaml").read_text()
    cfg = load_run_config(None, overrides(tmp_path, "learner.optim.lr=3e-4"))
    folder = read_folder(cfg)
    assert [f.key for f in folder_findings(cfg, folder, resume_with_changes=False)] == ["trainer.output_dir"]  # fmt: skip
    assert folder_findings(cfg, folder, resume_with_changes=True) == []
    write_config(run, cfg)
    [kept] = run.glob("config.*.yaml")
    assert kept.read_text() == old_text
    assert (run / "config.yaml").read_text() == yaml.safe_dump(to_dict(cfg), sort_keys=False)


def test_a_fresh_start_over_checkpoints_refuses_and_an_empty_start_is_taken_over(tmp_path):
    earlier_run(tmp_path)
    cfg = load_run_config(None, overrides(tmp_path, "trainer.resume=disable"))
    [finding] = folder_findings(cfg, read_folder(cfg), resume_with_changes=True)
    assert finding.key == "trainer.resume" and "write over them" in finding.problem
    # a run that wrote its config and failed before its first step holds nothing to keep
    other = tmp_path / "other"
    started = load_run_config(None, overrides(tmp_path, f"trainer.output_dir={other}", "rollout.n=2"))  # fmt: skip
    other.mkdir()
    write_config(other, started)
    cfg = load_run_config(None, overrides(tmp_path, f"trainer.output_dir={other}"))
    assert folder_findings(cfg, read_folder(cfg), resume_with_changes=False) == []
