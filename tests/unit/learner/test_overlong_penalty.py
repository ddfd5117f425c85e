"""DAPO's soft overlong punishment: the formula, its place before advantages, its config rule."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from launcher.config import ConfigError, load_run_config
from learner.algorithms import overlong_penalty
from learner.batching import GlobalBatch
from learner.config import LearnerConfig
from learner.prepare import make_kl_controller, prepare_targets
from learner.synthetic import synthetic_batch

# (length, expected penalty) for max_response_length 20, buffer 4, factor 1: free up to 16,
# then linear down to -1 at the cap (DAPO: -(L - (max - buffer)) / buffer * factor, at most 0)
CASES = [(0, 0.0), (10, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0)]


@pytest.mark.parametrize(("length", "expected"), CASES)
def test_penalty_follows_dapos_formula(length, expected):
    got = overlong_penalty(torch.tensor([length]), 20, 4, 1.0)
    assert got.item() == pytest.approx(expected)
    assert overlong_penalty(torch.tensor([length]), 20, 4, 0.5).item() == pytest.approx(
        expected * 0.5
    )


@pytest.mark.parametrize("buffer_len", [0, 20, 25])
def test_a_buffer_outside_the_cap_is_refused(buffer_len):
    with pytest.raises(ValueError, match="buffer_len must be in"):
        overlong_penalty(torch.tensor([3]), 20, buffer_len, 1.0)


def _targets(lens, scores, **algorithm):
    gb = GlobalBatch.from_arrow(
        synthetic_batch(
            vocab_size=50, groups=1, group_size=4, prompt_lens=3, response_lens=list(lens), seed=2
        )
    )
    gb = GlobalBatch(**{**gb.__dict__, "scores": np.asarray(scores, dtype=gb.scores.dtype)})
    cfg = msgspec.convert({"algorithm": {"norm_by_std": False, **algorithm}}, LearnerConfig)
    return prepare_targets(
        gb, cfg, prox_logprob=None, ref_logprob=None, values=None,
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"), max_response_length=20,
    )  # fmt: skip


def test_the_penalty_enters_the_scores_before_group_advantages():
    lens, scores = (5, 18, 20, 10), (1.0, 1.0, 1.0, 0.0)
    plain, _ = _targets(lens, scores)
    shaped, metrics = _targets(lens, scores, overlong_buffer_len=4)
    penalised = [1.0, 0.5, 0.0, 0.0]  # 18 tokens: -0.5, 20 tokens: -1.0
    mean = sum(penalised) / 4
    for row, value in enumerate(penalised):  # GRPO without std: score - group mean
        assert shaped.advantages[row, 0].item() == pytest.approx(value - mean)
    assert plain.advantages[1, 0].item() == pytest.approx(1.0 - 0.75)
    assert metrics["reward/overlong_frac"] == 0.5
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-1.5 / 4)


def test_config_rule_and_worker_need_the_cap(tmp_path):
    with pytest.raises(ConfigError, match="learner.algorithm.overlong_buffer_len"):
        load_run_config(
            None, ["rollout.max_new_tokens=16", "learner.algorithm.overlong_buffer_len=16"]
        )
    from fleetrl.models.config import ModelConfig
    from learner.worker import LearnerWorker

    cfg = msgspec.convert({"algorithm": {"overlong_buffer_len": 4}}, LearnerConfig)
    with pytest.raises(ValueError, match="needs the response cap"):
        LearnerWorker(
            cfg, ModelConfig(path=str(tmp_path)), rank=0, world_size=1,
            master_addr="127.0.0.1", master_port=1, seed=0,
        )  # fmt: skip
