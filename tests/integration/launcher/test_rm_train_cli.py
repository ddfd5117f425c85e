"""`fleetrl rm train` end to end on a tiny config (a local Ray instance), then `fleetrl rm eval`.

One run builds its tiny base and the demo's synthetic pairs, trains 4 steps with
held-out scores every 2 and a checkpoint + reward-model folder every 2; a second run of
the same config with more steps resumes from the last checkpoint (trainer.resume=auto).
The exported folder must be what transformers loads and score the held-out pairs as the
trainer did: ``fleetrl rm eval`` over it reproduces the run's last held-out figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(900)  # two runs, each starting Ray: minutes on 2 shared cores


def _fleetrl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_cli")
    config = root / "rm.yaml"
    config.write_text(
        f"""
data:
  synth_task: add2_even
  train_files: [{root}/data/train.parquet]
  val_files: [{root}/data/test.parquet]
  synth_train_size: 120
  synth_test_size: 40
  train_batch_size: 8
  max_length: 48
model:
  path: {root}/model
  create_tiny: true
  tiny: {{layers: 1, hidden: 32, heads: 2, max_positions: 64}}
learner:
  optim: {{lr: 1.0e-3}}
trainer:
  total_steps: 4
  test_freq: 2
  save_freq: 2
  output_dir: {root}/run
  device: cpu
"""
    )
    first = _fleetrl("rm", "train", "--config", str(config))
    assert first.returncode == 0, first.stderr[-3000:]
    return root, config, first


def _metrics(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_each_step_and_held_out_scores_and_writes_checkpoints_and_the_folder(run):
    root, _, first = run
    assert "held-out after: accuracy" in first.stdout and "reward model:" in first.stdout
    records = _metrics(root)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # step 0: before training
    for key in ("train/loss", "train/acc", "train/chosen_reward", "train/reject_reward",
                "train/margin", "train/lr", "train/grad_norm", "perf/tokens_per_s"):  # fmt: skip
        assert all(isinstance(r[key], float) for r in records[1:]), key
    assert [("val/accuracy" in r) for r in records] == [True, False, True, False, True]
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["step_2", "step_4"]
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["data"]["train_pairs"] == 120 and summary["resumed_from"] is None


def test_the_folder_loads_in_transformers_and_scores_the_held_out_pairs_as_the_trainer_did(run):
    from transformers import AutoModelForSequenceClassification

    from fleetrl.models.reward_folder import read_reward_stats

    root, _, _ = run
    folder = root / "run" / "reward_model"
    _, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    last = _metrics(root)[-1]
    stats = read_reward_stats(folder)
    assert stats.mean == pytest.approx(last["val/score_mean"], abs=1e-6)
    assert stats.std == pytest.approx(last["val/score_std"], abs=1e-6)
    assert (stats.pairs, stats.accuracy) == (40, last["val/accuracy"])
    evaluated = _fleetrl("rm", "eval", "--model", str(folder), "--data", str(root / "data" / "test.parquet"))  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (line,) = evaluated.stdout.strip().splitlines()  # one JSON line
    got = json.loads(line)
    assert got["pairs"] == 40 and got["accuracy"] == last["val/accuracy"]
    for key in ("chosen_mean", "rejected_mean", "margin_mean"):
        assert got[key] == pytest.approx(last[f"val/{key}"], abs=1e-5), key


def test_the_same_config_with_more_steps_resumes_from_the_last_checkpoint(run):
    root, config, _ = run
    second = _fleetrl("rm", "train", "--config", str(config), "trainer.total_steps=6")
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_4")
    steps = [r["step"] for r in _metrics(root)]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # no re-done step, no second step-0 evaluation


def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["q", "r"], "chosen": ["a", "b"], "rejected": ["c", None]}), bad)  # fmt: skip
    for args, start in (
        (["rm", "train", f"data.train_files=[{bad}]", f"model.path={tiny_model_dir}"],
         f"fleetrl: dataset error in {bad}: row 1: field 'rejected'"),
        (["rm", "train", f"data.train_files=[{bad}]", f"model.path={tmp_path}/none"],
         "fleetrl: config error at model.path"),
        (["rm", "eval", "--model", str(tiny_model_dir), "--data", str(bad)],
         "fleetrl: reward model"),  # a causal LM is no reward model
    ):  # fmt: skip
        result = _fleetrl(*args, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(start), result.stderr
