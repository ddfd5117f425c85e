"""The reward-model folder the trainer writes, loaded by SGLang 0.5.23's own classes and loader.

Folders come from the trainer itself (``RewardModelWorker`` trained for a few steps, then
``learner.reward_export``, as ``fleetrl rm train`` writes them) over the tiny Qwen2 and
Llama models; SGLang loads each in a fresh process (``sglang_reward_model``). What is
proven: SGLang resolves the architecture to its reward-model class, every one of its
parameters holds the folder's tensor (so no weight it needs is missing), no ``lm_head``
is in the folder, and its head on the same hidden states scores what transformers
scores — for Qwen2 only because the folder carries a zero ``score.bias`` (without it
SGLang keeps a random bias and every score moves by it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from learner.reward_export import SCORE_BIAS_FILE
from tests.integration.learner import rm_procs

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)  # trains two tiny reward models, then SGLang loads


@pytest.fixture(scope="module")
def trained_folders(tiny_model_dir, tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for arch, base in (("qwen2", tiny_model_dir), ("llama", tiny_llama_dir)):
        out = tmp_path_factory.mktemp(f"rm_{arch}")
        pairs = rm_procs.write_pairs(out / "pairs.parquet")
        rm_procs.run_here(str(base), str(pairs), str(out), {})
        folders[arch] = out / "train_rm"
    return folders


def sglang_load(folder: Path, tmp_path: Path) -> dict:
    out = tmp_path / f"{folder.name}_sglang.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.conformance.sglang_reward_model", str(folder), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_transformers_loads_the_folder_with_no_missing_or_unexpected_key(trained_folders):
    from transformers import AutoModelForSequenceClassification

    for folder in trained_folders.values():
        _, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)  # fmt: skip
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), folder


def test_qwen2_folder_loads_in_sglang_whole_with_a_zero_bias_and_scores_as_transformers(
    trained_folders, tmp_path
):
    got = sglang_load(trained_folders["qwen2"], tmp_path)
    assert got["class"] == "Qwen2ForSequenceClassification"
    assert got["mismatched"] == []  # every SGLang parameter holds the folder's tensor
    assert got["params"]["score.weight"] == [1, 64] and got["params"]["score.bias"] == [1]
    assert got["score_bias"] == [0.0]
    assert not any(name.startswith("lm_head") for name in got["params"])
    assert got["head_max_abs_diff"] < 1e-5


def test_without_the_bias_file_sglang_keeps_a_random_qwen2_bias_and_every_score_moves(
    trained_folders, tmp_path
):
    folder = tmp_path / "no_bias"
    shutil.copytree(trained_folders["qwen2"], folder)
    (folder / SCORE_BIAS_FILE).unlink()
    got = sglang_load(folder, tmp_path)
    assert got["mismatched"] == ["score.bias"]  # the one parameter the checkpoint lacks
    (bias,) = got["score_bias"]
    assert bias != 0.0
    shifts = [s - t for s, t in zip(got["sglang_scores"], got["transformers_scores"], strict=True)]
    assert shifts == pytest.approx([bias] * len(shifts), abs=1e-5)


def test_llama_folder_loads_as_sglang_llama_sequence_classification_without_a_bias(
    trained_folders, tmp_path
):
    got = sglang_load(trained_folders["llama"], tmp_path)
    assert got["class"] == "LlamaForSequenceClassification"
    assert got["mismatched"] == []
    assert got["score_bias"] is None and "score.bias" not in got["params"]  # its loader skips ours
    assert got["head_max_abs_diff"] < 1e-5
