"""Preflight of the prompt files, the tokenizer and the reward function, before Ray starts.

The first test is the user's view: `fleetrl check` on a config with a file missing a
column, a file whose prompts are numbers, a tokenizer without a chat template while
`data.apply_chat_template` is on, and a reward function that raises on every row exits 2
with one line per problem, all at once, and never imports Ray (a `ray` package that
raises on import is first on the path). The others call the checks directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fleetrl.data.schema import write_rows
from fleetrl.models.tiny import build_tokenizer
from launcher.config import load_run_config
from launcher.preflight_data import check_data
from launcher.preflight_rewards import check_custom_function

REPO = Path(__file__).resolve().parents[3]
ROW = {
    "data_source": "synth/add",
    "prompt": [{"role": "user", "content": "3+5="}],
    "reward_model": {"style": "rule", "ground_truth": "8"},
}


def model_folder(path: Path, *, template: bool = True) -> Path:
    """A folder with config.json and the tiny character tokenizer (with or without its
    chat template): enough for the checks, which never load weights."""
    tokenizer = build_tokenizer()
    if not template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64, "intermediate_size": 128}))  # fmt: skip
    return path


def no_ray(tmp_path: Path) -> Path:
    """A folder whose `ray` package raises when imported: put first on PYTHONPATH."""
    (tmp_path / "noray" / "ray").mkdir(parents=True)
    (tmp_path / "noray" / "ray" / "__init__.py").write_text(
        'raise ImportError("ray imported: preflight must not start Ray")\n'
    )
    return tmp_path / "noray"


def cfg_for(tmp_path: Path, files: list[Path], *overrides: str):
    model = tmp_path / "model"
    if not model.exists():
        model_folder(model)
    return load_run_config(
        None,
        [f"data.train_files=[{','.join(map(str, files))}]", "data.val_files=[]",
         f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}", *overrides],
    )  # fmt: skip


def test_check_refuses_each_problem_in_one_line_all_at_once_before_ray(tmp_path):
    no_column = tmp_path / "no_reward_model.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "synth/add", "prompt": "1+1="}]), no_column)  # fmt: skip
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.Table.from_pylist([{**ROW, "prompt": 7}] * 3), numbers)
    good = write_rows([ROW, {**ROW, "reward_model": {"style": "rule", "ground_truth": "9"}}], tmp_path / "good.parquet")  # fmt: skip
    model = model_folder(tmp_path / "model", template=False)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return extra_info['difficulty']\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{no_ray(tmp_path)}{os.pathsep}{REPO}"
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "check",
         f"data.train_files=[{no_column},{numbers},{good}]", "data.val_files=[]",
         f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}",
         f"reward.custom_function.path={reward}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert all(line.startswith("fleetrl: preflight error at ") for line in lines), lines
    assert len(lines) == 4, lines
    missing, wrong_type, template, raises = lines
    assert f"data.train_files: {no_column}: missing column(s) reward_model" in missing
    assert f"data.train_files: {numbers}: row 0: field 'prompt'" in wrong_type
    assert "got int 7 (and 2 more rows)" in wrong_type
    assert "data.apply_chat_template: true, and the tokenizer" in template
    assert "has no chat template" in template
    assert "reward.custom_function.path: 'compute_score' in" in raises
    assert f"failed on {good} row 0" in raises and "raised KeyError('difficulty')" in raises
    assert not (tmp_path / "run").exists()


def test_plain_string_prompts_and_rows_without_optional_columns_pass(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([{**ROW, "prompt": "3+5="}] * 2), plain)
    findings, rows = check_data(cfg_for(tmp_path, [plain]))
    assert findings == []
    assert [row["prompt"] for _, _, _, row in rows.samples] == ["3+5=", "3+5="]
    assert rows.samples[0][3]["extra_info"] == {} and rows.samples[0][3]["ability"] == ""


def test_multi_turn_needs_chat_messages(tmp_path):
    plain = write_rows([{**ROW, "prompt": "3+5="}], tmp_path / "plain.parquet")
    cfg = cfg_for(tmp_path, [plain], "rollout.multi_turn.env=calculator")
    [finding], _ = check_data(cfg)
    assert finding.key == "data.train_files" and "rollout.multi_turn.env" in finding.problem


def test_a_template_that_raises_and_an_over_long_prompt_with_truncation_error(tmp_path):
    model = model_folder(tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = "{{ raise_exception('this template takes no user turns') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    good = write_rows([ROW], tmp_path / "good.parquet")
    [finding], _ = check_data(cfg_for(tmp_path, [good]))
    assert finding.key == "data.train_files" and f"{good}: row 0: rendering the prompt" in finding.problem  # fmt: skip
    assert "this template takes no user turns" in finding.problem
    long = write_rows([{**ROW, "prompt": "1+2=" * 40}], tmp_path / "long.parquet")
    cfg = cfg_for(tmp_path, [long], "data.truncation=error", "data.max_prompt_length=16")
    [finding], _ = check_data(cfg)
    assert finding.key == "data.max_prompt_length" and "160 tokens, more than 16" in finding.problem


def test_the_reward_trial_calls_the_function_as_the_run_does(tmp_path):
    data = write_rows([ROW, {**ROW, "reward_model": {"style": "rule", "ground_truth": "9"}}], tmp_path / "d.parquet")  # fmt: skip
    reward = tmp_path / "r.py"
    reward.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info, scale=1.0):\n"
        "    return float(solution_str == ground_truth) * scale\n"
        "def batched(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    return [1.0] * (len(solution_strs) - 1)\n"
        "def slow(data_source, solution_str, ground_truth, extra_info):\n"
        "    time.sleep(3)\n    return 1.0\n"
        "def judge(data_source, solution_str, ground_truth, extra_info, engine_urls=None):\n"
        "    raise RuntimeError('needs the run')\n"
    )  # fmt: skip

    def findings(*overrides: str):
        cfg = cfg_for(tmp_path, [data], f"reward.custom_function.path={reward}", *overrides)
        return check_custom_function(cfg, check_data(cfg)[1].samples)

    assert findings("reward.custom_function.reward_kwargs={scale: 2.0}") == []
    [wrong_count] = findings("reward.custom_function.name=batched")
    assert "batched reward returned 1 scores for 2 samples" in wrong_count.problem
    [slow] = findings("reward.custom_function.name=slow", "rollout.reward_timeout_s=0.5")
    assert not slow.fatal and "did not return within 0.5 s" in slow.problem
    assert findings("reward.custom_function.name=judge") == []  # scores through the run's servers
