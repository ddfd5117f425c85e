"""Multi-turn training end to end: `fleetrl train` with a tool environment, on local Ray.

A scripted environment (``one_reply`` below, named as ``module:function``) answers
every sample's first turn with a tool message, so each response holds tokens the
policy did not write. Proves the path from the rollout driver through the wire,
the buffer and the learner: every step's batch has tool tokens
(``response/trained_token_fraction`` < 1, two turns per sample), the loss stays
finite, the staleness bound holds, and the run exits 0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def one_reply(messages, extra_info):
    """The environment: one tool reply after the policy's first turn, then done."""
    turns = sum(m["role"] == "assistant" for m in messages)
    return {"role": "tool", "content": "result: 42"} if turns == 1 else None


@pytest.mark.timeout(900)
def test_training_with_a_tool_environment_masks_its_tokens_and_runs(tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_cpu.yaml",
        f"trainer.output_dir={run_dir}", f"trainer.total_steps={STEPS}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "data.synth_task=calc", "data.train_batch_size=4",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
        "data.max_prompt_length=140",
        f"model.path={tmp_path / 'model'}", "model.warmstart.steps=0",
        "model.tiny.max_positions=224", "rollout.max_new_tokens=64",
        "rollout.multi_turn.env=tests.e2e.test_multi_turn_train:one_reply",
        "rollout.multi_turn.max_turns=3",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == STEPS
    for row in steps:
        assert 0 < row["response/trained_token_fraction"] < 1, row["step"]
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert row["staleness/max"] <= 2
    key = "rollout/multi_turn/turns_per_sample"
    turns = [r[key] for r in rows if key in r]
    # > 1: samples whose first turn ended before the budget got a second turn after the reply
    assert turns and max(turns) > 1
