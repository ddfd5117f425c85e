"""Agent training end to end: `fleetrl train` with rollout.agent.entrypoint on local Ray.

The agent is a file outside the package (a copy of examples/agents/calculator_agent.py
in the test's folder, as a user's own file is): it talks to the run's gateway with the
``openai`` client. A shortened ``make demo-agent``: the demo's data and model builder
with a few warm-start steps, two GRPO steps and a validation by the same agent. Proves the
path from the agent through the gateway, the worker, the buffer and the bank to the learner
(finite loss, the staleness bound), and ``fleetrl inspect rollouts RUN_DIR --json``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_users_agent_file_trains_through_the_gateway(tmp_path: Path):
    demo, run_dir = tmp_path / "demo", tmp_path / "run"
    built = _run([sys.executable, "examples/agents/build_calculator_demo.py", "--out", str(demo),
                  "--train-size", "64", "--test-size", "8", "--steps", "10"])  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    agent = tmp_path / "user_agent.py"
    shutil.copy(REPO / "examples" / "agents" / "calculator_agent.py", agent)
    train = _run([
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_agent_cpu.yaml",
        f"trainer.output_dir={run_dir}", f"trainer.total_steps={STEPS}", f"trainer.test_freq={STEPS}",
        "trainer.save_freq=-1", "data.train_batch_size=2", "rollout.n=4",
        f"data.train_files=[{demo / 'data/train.parquet'}]",
        f"data.val_files=[{demo / 'data/test.parquet'}]", "data.val_max_samples=4",
        f"model.path={demo / 'model'}", f"rollout.agent.entrypoint={agent}:run",
    ])  # fmt: skip
    assert train.returncode == 0, train.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == STEPS
    for row in steps:
        assert math.isfinite(row["actor/pg_loss"]) and row["staleness/max"] <= 2
    last = (
        rows[-1]
        if "agent/episodes" in rows[-1]
        else next(r for r in reversed(rows) if "agent/episodes" in r)
    )
    assert (
        last["agent/episodes"] >= STEPS * 2 * 4
        and last["agent/gateway_calls"] >= last["agent/episodes"]
    )
    assert any("val/num_samples" in r and r["val/num_samples"] > 0 for r in rows)
    shown = _run(
        [sys.executable, "-m", "launcher.cli", "inspect", "rollouts", str(run_dir), "--json"]
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    records = [json.loads(line) for line in shown.stdout.splitlines()]
    assert len(records) >= STEPS * 2
    for record in records:
        assert record["episode"].startswith(record["group_id"] + "/e")
        assert len(record["loss_mask"]) == len(record["token_ids"]) == len(record["versions"])
        assert record["reward"] in (0.0, 1.0)
        assert sum(record["loss_mask"]) > 0
