"""A fresh start never reloads an earlier run's rollout bank (it would serve stale groups)."""

from __future__ import annotations

from pathlib import Path

from launcher.config import load_run_config
from launcher.session import Run


def _run(tmp_path: Path, *overrides: str) -> Run:
    cfg = load_run_config(None, [f"trainer.output_dir={tmp_path}", *overrides])
    return Run(cfg, address=None)


def test_bank_without_a_checkpoint_is_set_aside(tmp_path: Path):
    bank = tmp_path / "rollout_bank"
    bank.mkdir()
    (bank / "segment_000000.arrow").write_bytes(b"earlier run")
    _run(tmp_path).set_aside_unowned_bank()
    assert not bank.exists()
    (aside,) = tmp_path.glob("rollout_bank.set-aside-*")
    assert (aside / "segment_000000.arrow").read_bytes() == b"earlier run"  # kept, not deleted


def test_empty_or_missing_bank_is_left_alone(tmp_path: Path):
    _run(tmp_path).set_aside_unowned_bank()
    (tmp_path / "rollout_bank").mkdir()
    _run(tmp_path).set_aside_unowned_bank()
    assert (tmp_path / "rollout_bank").is_dir()
    assert not list(tmp_path.glob("rollout_bank.set-aside-*"))
