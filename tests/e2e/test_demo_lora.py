"""The CPU demo with LoRA on (``learner.lora.rank=8``), end to end as ``fleetrl train`` runs it.

Proves: every version travels as an adapter only (the same bytes each version, the
size of a rank-8 adapter, well under the model's), loaded by the embedded engine
through ``/load_lora_adapter`` with no failure; the adapter folders of the current
and the previous version are all that stay on disk; rollout requests follow the
adapter (tokens carry versions within the staleness bound). Run again, longer, it
resumes from the checkpoint and loads the restored adapter before generating
(``publish_restored``), and versions continue.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_demo_loop import ENV, REPO
from tests.e2e.test_demo_loop import _command as demo_command
from weight_sync.adapters import adapter_name

DEMO_FULL_SYNC_BYTES = 579_328  # fp32 demo model (bench weight-sync, full sync)


def _command(tmp_path: Path, run_dir: Path, steps: int) -> list[str]:
    return demo_command(tmp_path, run_dir, steps) + ["learner.lora.rank=8"]


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "actor/pg_loss" in r]


@pytest.mark.timeout(900)
def test_demo_with_lora_syncs_adapters_only_and_resumes(tmp_path: Path):
    env = ENV
    run_dir = tmp_path / "run"
    first = subprocess.run(
        _command(tmp_path, run_dir, 6), cwd=REPO, env=env, capture_output=True, text=True,
        timeout=480,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    records = _train_records(run_dir)
    assert [r["policy_version"] for r in records] == list(range(1, 7))
    sizes = {r["weight_sync/bytes"] for r in records}
    assert len(sizes) == 1 and 0 < sizes.pop() * 5 < DEMO_FULL_SYNC_BYTES
    assert all(r["weight_sync/num_failed"] == 0 for r in records)
    assert all(r["staleness/max"] <= 2 for r in records)
    adapters = run_dir / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == [adapter_name(5), adapter_name(6)]

    second = subprocess.run(
        _command(tmp_path, run_dir, 8), cwd=REPO, env=env, capture_output=True, text=True,
        timeout=480,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-4000:]
    later = [r for r in _train_records(run_dir) if r["step"] > 6]
    assert [r["policy_version"] for r in later] == [7, 8]
    assert all(r["weight_sync/num_failed"] == 0 for r in later)
    assert sorted(p.name for p in adapters.iterdir()) == [adapter_name(7), adapter_name(8)]
    learner_log = (run_dir / "logs" / "learner-0.log").read_text()
    assert "publishing the restored policy as version 6" in learner_log
