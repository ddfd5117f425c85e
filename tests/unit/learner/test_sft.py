"""The supervised warm start trains a tiny model folder in place, on the CPU or the run's GPU."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from fleetrl.models.config import WarmStartConfig
from fleetrl.models.loading import load_causal_lm
from learner.sft import corrupt_answer, supervised_warmstart

EXAMPLES = [
    ([{"role": "user", "content": f"{a}+{b}="}], str(a + b)) for a in range(5) for b in range(5)
]


def _warm(folder, device: str) -> float:
    cfg = WarmStartConfig(steps=8, lr=3e-3, batch_size=8, label_noise=0.0, seed=0)
    return supervised_warmstart(folder, EXAMPLES, cfg, device=device)


def _check_warm_start_changes_the_saved_weights(tiny_model_dir, tmp_path, device):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    before = load_causal_lm(folder).state_dict()
    loss = _warm(folder, device)
    after = load_causal_lm(folder).state_dict()
    assert math.isfinite(loss)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(t.device.type == "cpu" for t in after.values())  # saved from the host


def test_the_warm_start_trains_and_saves_the_folder_on_the_cpu(tiny_model_dir, tmp_path):
    _check_warm_start_changes_the_saved_weights(tiny_model_dir, tmp_path, "cpu")


@pytest.mark.gpu
def test_the_warm_start_runs_on_the_gpu_when_the_run_does(tiny_model_dir, tmp_path):
    _check_warm_start_changes_the_saved_weights(tiny_model_dir, tmp_path, "cuda")


def test_wrong_labels_are_off_by_one_or_reversed():
    assert corrupt_answer("41") == "42"
    assert corrupt_answer("abc") == "cba?"
