"""trainer.resume_from_path: the folder must be a complete checkpoint, and this run's newer
checkpoints are moved aside (not deleted) so that a later resume=auto follows the new branch."""

from __future__ import annotations

import pytest

from launcher.resume_path import checkpoint_step, checkpoint_to_resume, set_aside_newer
from launcher.supervision import TrainingStopped


def test_newer_checkpoints_are_moved_aside_and_older_ones_stay(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "marker").write_text(str(step))
    aside = set_aside_newer(root, 4)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert aside is not None and sorted(p.name for p in aside.iterdir()) == ["step_6", "step_8"]
    assert (aside / "step_8" / "marker").read_text() == "8"  # moved whole, nothing lost
    assert set_aside_newer(root, 4) is None  # nothing newer left


def test_a_folder_that_is_no_complete_checkpoint_names_the_key(tmp_path):
    (tmp_path / "global_step_10" / "actor").mkdir(parents=True)  # a verl checkpoint
    with pytest.raises(TrainingStopped, match=r"trainer\.resume_from_path: .*global_step_10"):
        checkpoint_to_resume(str(tmp_path / "global_step_10"))
    with pytest.raises(TrainingStopped, match="not a directory"):
        checkpoint_to_resume(str(tmp_path / "absent"))
    with pytest.raises(TrainingStopped, match="step_<N>"):
        checkpoint_step(tmp_path / "global_step_10")
    assert checkpoint_step(tmp_path / "step_12") == 12
