"""The CPU demo co-located (``rollout.placement=colocated``) end to end, as `fleetrl train` runs it.

Proves, for a few versions on local Ray: the engine shares learner rank 0's bundle and
gives its memory back for every learner step (``colocate/*``: one engine released, bytes
released, the push by handle), every version reaches it, the staleness bound holds with
nothing refused at hand-out, exit status 0. A mixed run (one engine co-located, one on a
rollout "node" of its own: ``rollout.colocate.remote_engines=1``) gets every version to
both, the co-located one by handle and the remote one by broadcast, and both serve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
REPO = Path(__file__).resolve().parents[2]
ETA = 2
STEPS = 5


def _run(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    run_dir = tmp_path / name
    cmd = [
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_cpu.yaml",
        f"trainer.output_dir={run_dir}",
        f"trainer.total_steps={STEPS}",
        "trainer.test_freq=-1",
        f"buffer.max_staleness={ETA}",
        f"model.path={tmp_path / 'model'}",
        "model.warmstart.steps=30",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
        "rollout.placement=colocated",
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["policy_version"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["staleness/max"] <= ETA and r["buffer/refused_stale"] == 0
        assert r["weight_sync/num_failed"] == 0
    return steps


@pytest.mark.timeout(1500)
def test_the_demo_runs_colocated_and_mixed_with_the_memory_released_every_step(tmp_path):
    for r in _run(tmp_path, "colocated"):
        assert r["colocate/engines_released"] == 1.0  # during this step
        assert r["colocate/bytes_released"] > 0 and r["colocate/push_bytes"] > 0
        assert r["colocate/push_s"] > 0 and r["colocate/release_s"] > 0
        assert r["fleet/engines_alive"] == 1 and r["weight_sync/num_engines"] == 1

    mixed = _run(
        tmp_path,
        "mixed",
        "rollout.num_engines=2",
        "rollout.colocate.remote_engines=1",
        "rollout.cpus_per_engine=0.5",
        "learner.cpus_per_rank=0.5",
    )
    for r in mixed:
        assert r["colocate/engines_released"] == 1.0  # only the co-located one gives way
        assert r["weight_sync/num_engines"] == 2 and r["fleet/engines_alive"] == 2
        assert r["weight_sync/bytes"] > 0 and r["colocate/push_bytes"] > 0  # both paths
