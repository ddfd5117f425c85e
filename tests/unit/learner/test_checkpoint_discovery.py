"""latest_complete_checkpoint: newest whole checkpoint wins; partial or corrupt ones are skipped."""

from __future__ import annotations

import json
import logging

from learner.checkpoint import checkpoint_problem, latest_complete_checkpoint


def fake_checkpoint(root, step, *, world=2, complete=True):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    (d / "meta.json").write_text(json.dumps({"step": step, "world_size": world}))
    for r in range(world):
        (d / f"rng_rank{r}.pt").write_bytes(b"x")
    if complete:
        (d / "COMPLETE").write_text("ok")
    return d


def test_latest_complete_checkpoint_picks_highest_step_numerically(tmp_path):
    for step in (2, 10, 9):
        fake_checkpoint(tmp_path, step)
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "step_10"
    assert latest_complete_checkpoint(tmp_path / "absent") is None


def test_incomplete_and_corrupt_checkpoints_fall_back_with_a_log_line(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(logging.getLogger("fleetrl"), "propagate", True)  # reach caplog
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2, complete=False)
    broken = fake_checkpoint(tmp_path, 3)
    (broken / "rng_rank1.pt").unlink()
    (tmp_path / "step_4.tmp").mkdir()
    with caplog.at_level(logging.WARNING, logger="fleetrl"):
        assert latest_complete_checkpoint(tmp_path) == tmp_path / "step_1"
    text = caplog.text
    assert "step_4.tmp" in text and "rng_rank1.pt missing" in text and "COMPLETE" in text
    assert checkpoint_problem(tmp_path / "step_1") is None
