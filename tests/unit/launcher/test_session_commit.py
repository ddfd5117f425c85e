"""The driver commits one checkpoint late and names the prompts it may still regenerate."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import ray

from launcher.config import load_run_config
from launcher.results import CheckpointRecord
from launcher.session import Run


class _Call:
    def __init__(self, fn):
        self.remote = fn


def test_commit_retains_the_unfinished_prompts_of_every_resumable_checkpoint(
    tmp_path: Path, monkeypatch
):
    run = Run(load_run_config(None, [f"trainer.output_dir={tmp_path}"]), address=None)
    state = {"watermark": 0, "unfinished": []}
    commits: list[tuple[int, list[str]]] = []
    learner = SimpleNamespace(
        save_checkpoint=_Call(
            lambda root, extra: CheckpointRecord(
                path=f"{root}/step",
                step=extra["step"],
                policy_version=0,
                watermark=state["watermark"],
            )
        ),
        commit_buffer=_Call(lambda w, retain: commits.append((w, retain))),
    )
    run.learners = [learner]
    run.rollout = SimpleNamespace(
        reader_state=_Call(lambda: {"unfinished_prompts": list(state["unfinished"])})
    )
    monkeypatch.setattr(ray, "get", lambda x, **kw: x)
    monkeypatch.setattr("launcher.session.gather", lambda refs, what: list(refs))
    for watermark, unfinished in ((16, [17, 18]), (32, [33]), (32, []), (48, [50])):
        state.update(watermark=watermark, unfinished=unfinished)
        run.checkpoint(watermark)
    # commit W_prev; resumable = checkpoints whose watermark >= W_prev
    assert commits == [
        (16, ["p17", "p18", "p33"]),
        (32, ["p33"]),  # the checkpoints at 32 (twice) remain resumable
        (32, ["p33", "p50"]),
    ]


def test_old_checkpoints_are_removed_beyond_keep_checkpoints(tmp_path: Path, monkeypatch):
    run = Run(
        load_run_config(None, [f"trainer.output_dir={tmp_path}", "trainer.keep_checkpoints=1"]),
        address=None,
    )
    for step in (3, 6, 9):
        (run.ckpt_root / f"step_{step}").mkdir(parents=True)
    monkeypatch.setattr(
        "launcher.session.checkpoint_candidates",
        lambda root: sorted(Path(root).iterdir(), key=lambda p: -int(p.name[5:])),
    )
    run.remove_old_checkpoints()
    assert sorted(p.name for p in run.ckpt_root.iterdir()) == ["step_6", "step_9"]  # 2 kept
