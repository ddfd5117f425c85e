"""`trainer.resume_from_path`: start from a chosen checkpoint instead of the newest one.

verl's ``resume_mode=resume_path``. A checkpoint resumed this way may be older than
the rollout bank's commit or come from another run, so its hand-out watermark means
nothing to this run's bank: the bank starts empty (``Run.set_aside_unowned_bank``)
and the buffer resumes at watermark 0, with admission's counter at v·B. What the
checkpoint holds (policy, optimizer, critic, schedules, step, reader cursor and
the prompts it had not finished) is loaded as on any resume, so prompts whose
groups were generated but never trained on are generated again.

Checkpoints of this run newer than the chosen one are moved aside (never deleted):
left in place, a later ``resume=auto`` would pick them and leave the new branch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fleetrl.log import get_logger
from launcher.supervision import TrainingStopped

log = get_logger(__name__)

KEY = "trainer.resume_from_path"


def checkpoint_to_resume(path: str) -> Path:
    """The complete checkpoint folder ``path`` names; ``TrainingStopped`` naming the key if not."""
    from learner.checkpoint import checkpoint_problem

    folder = Path(os.path.expanduser(path)).resolve()
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise TrainingStopped(
            f"{KEY}: {folder} is not a complete fleetrl checkpoint ({problem}); give a "
            "<run dir>/checkpoints/step_N folder (verl's own checkpoints cannot be loaded)"
        )
    return folder


def checkpoint_step(folder: Path) -> int:
    name = folder.name
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise TrainingStopped(f"{KEY}: {folder} is not a step_<N> checkpoint folder")
    return int(name[5:])


def set_aside_newer(ckpt_root: Path, step: int) -> Path | None:
    """Move this run's checkpoints after ``step`` into a set-aside folder; it, or None."""
    if not ckpt_root.is_dir():
        return None
    newer = [
        child
        for child in ckpt_root.iterdir()
        if child.name.startswith("step_")
        and child.name[5:].isdigit()
        and int(child.name[5:]) > step
    ]
    if not newer:
        return None
    aside = ckpt_root.with_name(f"{ckpt_root.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir(parents=True, exist_ok=True)
    for child in newer:
        child.rename(aside / child.name)
    log.warning(
        "%s resumes step %d: %d newer checkpoints moved to %s", KEY, step, len(newer), aside
    )
    return aside
