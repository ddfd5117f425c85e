"""Preflight of the reward section: a custom reward file that cannot work, a folder that is no
reward model, data sources nobody scores and a missing reward-server key are found before
any role starts; the CLI exits 2 with one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.data.schema import write_rows
from fleetrl.models.tiny import make_tiny_model
from launcher.config import load_run_config
from launcher.preflight_rewards import check_rewards

REPO = Path(__file__).resolve().parents[3]


def _rows(source: str, count: int = 2) -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(count)
    ]


def _cfg(tmp_path: Path, *overrides: str, source: str = "synth/add"):
    train = write_rows(_rows(source), tmp_path / "train.parquet")
    return load_run_config(None, [f"data.train_files=[{train}]", *overrides])


def _keys(findings) -> list[tuple[str, bool]]:
    return [(f.key, f.fatal) for f in findings]


def test_a_missing_or_broken_custom_reward_file_is_found(tmp_path):
    missing = check_rewards(_cfg(tmp_path, f"reward.custom_function.path={tmp_path}/nope.py"))
    assert _keys(missing) == [("reward.custom_function.path", True)]
    assert "nope.py not found" in missing[0].problem
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def compute_score(text):\n    return 1.0\n")
    found = check_rewards(_cfg(tmp_path, f"reward.custom_function.path={wrong}"))
    assert _keys(found) == [("reward.custom_function.path", True)]
    assert "cannot be called as a reward function" in found[0].problem


def test_a_data_source_no_function_scores_is_found_unless_the_function_claims_it(tmp_path):
    found = check_rewards(_cfg(tmp_path, source="my/task"))
    assert _keys(found) == [("data.train_files", True)]
    assert "data_source 'my/task', which no reward function scores" in found[0].problem
    good = tmp_path / "good.py"
    good.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")  # fmt: skip
    claimed = _cfg(
        tmp_path, f"reward.custom_function.path={good}", "reward.custom_function.data_sources=[my/*]",
        source="my/task",
    )  # fmt: skip
    assert check_rewards(claimed) == []
    assert check_rewards(_cfg(tmp_path, source="synth/add")) == []  # a built-in


def test_the_data_sources_are_read_from_each_file_without_importing_pandas(tmp_path):
    """The scan runs beside the local Ray instance's start: ``pq.read_table`` would import
    pyarrow.dataset and pandas (a second of CPU); a file it cannot read is left to the reader."""
    a = write_rows(_rows("synth/add"), tmp_path / "a.parquet")
    b = write_rows(_rows("my/task"), tmp_path / "b.parquet")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    code = (
        "import sys\n"
        "from launcher.preflight_rewards import _data_sources\n"
        f"print(sorted(_data_sources([{str(a)!r}, {str(broken)!r}, {str(b)!r}, 'gone.parquet']).items()))\n"
        "print('pandas' in sys.modules, 'pyarrow.dataset' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [str([("my/task", str(b)), ("synth/add", str(a))]), "False False"]


def test_with_a_reward_model_and_rule_weight_zero_no_rule_scorer_is_needed(tmp_path):
    rm = make_tiny_model(tmp_path / "rm", layers=1, hidden=16, heads=2, reward_model=True)
    cfg = _cfg(
        tmp_path, f"reward.model.path={rm}", "reward.model.urls=[http://127.0.0.1:1]",
        "reward.rule_weight=0", source="my/task",
    )  # fmt: skip
    assert check_rewards(cfg) == []


def test_a_folder_that_is_no_reward_model_is_found(tmp_path):
    policy = make_tiny_model(tmp_path / "policy", layers=1, hidden=16, heads=2)
    cfg = _cfg(tmp_path, f"reward.model.path={policy}", "reward.model.urls=[http://127.0.0.1:1]")
    found = check_rewards(cfg)
    assert _keys(found) == [("reward.model.path", True)]
    assert "ForSequenceClassification" in found[0].problem


@pytest.mark.timeout(120)
def test_fleetrl_train_refuses_a_bad_custom_reward_file_before_any_role_starts(tmp_path):
    broken = tmp_path / "my_reward.py"
    broken.write_text("raise RuntimeError('cannot import me')\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "train",
            "--config",
            "configs/demo_cpu.yaml",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            "data.val_files=[]",
            f"reward.custom_function.path={broken}",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("fleetrl: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("fleetrl: preflight error at reward.custom_function.path: ")
    assert "cannot import me" in lines[0]
    assert not (tmp_path / "model").exists()  # nothing was built: no role started
