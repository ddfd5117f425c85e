"""Batch metrics (staleness, lengths) and per-token targets computed over the global batch."""

from __future__ import annotations

import msgspec
import pytest
import torch

from learner.batching import GlobalBatch
from learner.config import LearnerConfig
from learner.prepare import batch_metrics, make_kl_controller, prepare_targets
from learner.synthetic import synthetic_batch


def make(versions, lens=(2, 3, 0, 4)) -> GlobalBatch:
    return GlobalBatch.from_arrow(
        synthetic_batch(
            vocab_size=50,
            groups=2,
            group_size=2,
            prompt_lens=3,
            response_lens=list(lens),
            token_versions=versions,
            seed=1,
        )  # fmt: skip
    )


def test_staleness_is_learner_version_minus_oldest_token_version():
    gb = make([3, 5, 0, 4])  # the empty response (row 2) has no tokens: not counted
    metrics = batch_metrics(gb, policy_version=5)
    assert metrics["staleness/max"] == 2.0
    assert metrics["staleness/mean"] == pytest.approx((2 + 0 + 1) / 3)
    assert (metrics["staleness/hist_0"], metrics["staleness/hist_1"]) == (1.0, 1.0)
    assert metrics["staleness/hist_2"] == 1.0
    assert metrics["response_length/clip_ratio"] == 0.5
    assert metrics["perf/total_num_tokens"] == 4 * 3 + 9


def test_mid_sequence_weight_update_uses_the_oldest_version():
    gb = make(0)
    versions = gb.token_versions.copy()
    versions[gb.response_offsets[3] + 1 :] = 7  # the last sample's tail came from version 7
    gb = GlobalBatch(**{**gb.__dict__, "token_versions": versions})
    assert batch_metrics(gb, policy_version=7)["staleness/max"] == 7.0


def test_bypass_uses_behavior_logprobs_and_no_weights_decoupled_weights_them():
    gb = make(0)
    cfg = msgspec.convert({"correction": {"mode": "bypass"}}, LearnerConfig)
    targets, metrics = prepare_targets(
        gb, cfg, prox_logprob=None, ref_logprob=None, values=None,
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
    )  # fmt: skip
    assert targets.is_weights is None
    assert targets.old_logprob[3, :4].tolist() == pytest.approx(gb.behavior_logprobs[5:9].tolist())
    cfg = msgspec.convert({"correction": {"mode": "decoupled"}}, LearnerConfig)
    prox = targets.old_logprob + 0.1 * targets.mask
    targets, metrics = prepare_targets(
        gb, cfg, prox_logprob=prox, ref_logprob=None, values=None,
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
    )  # fmt: skip
    assert metrics["is/weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.1))), rel=1e-5)
    # GRPO: advantages are constant within each sample and zero on padding.
    assert targets.advantages[1, 3:].abs().sum() == 0


def test_gae_without_values_is_a_clear_error():
    gb = make(0)
    cfg = msgspec.convert({"algorithm": {"adv_estimator": "gae"}}, LearnerConfig)
    with pytest.raises(ValueError, match="critic"):
        prepare_targets(
            gb, cfg, prox_logprob=None, ref_logprob=None, values=None,
            kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
        )  # fmt: skip
