"""Multi-turn loss masks in the learner's batch, counts, metrics and targets.

A tool's or environment's reply inside a response (loss mask 0) is context only:
``response_mask`` excludes it, token and sequence counts skip it, the score lands
on the last trained token, and advantages are 0 on it.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import torch

from learner import algorithms as alg
from learner.batching import BatchError, GlobalBatch, global_counts, padded, response_mask
from learner.config import LearnerConfig
from learner.prepare import batch_metrics, make_kl_controller, prepare_targets
from learner.synthetic import synthetic_batch

LENS = [6, 5, 7, 4, 6, 5]
MASKS = [
    [1, 1, 0, 0, 1, 1],  # a tool reply inside the response
    None,  # every token the policy's
    [1, 1, 1, 0, 0, 0, 0],  # ends on a tool reply
    [0, 0, 0, 0],  # tool tokens only
    [1, 0, 1, 0, 1, 0],
    [1, 1, 1, 0, 1],
]
SCORES = [1.0, 0.0, 1.0, 0.25, 1.0, 0.5]


def masked_batch(versions=0, masks=MASKS) -> GlobalBatch:
    arrow = synthetic_batch(
        vocab_size=50, groups=2, group_size=3, prompt_lens=[3, 4], response_lens=LENS,
        seed=3, token_versions=versions, loss_masks=masks,
    )  # fmt: skip
    gb = GlobalBatch.from_arrow(arrow)
    return dataclasses.replace(gb, scores=np.array(SCORES, dtype=np.float32))


def flat_mask(masks=MASKS) -> list[int]:
    return [v for m, n in zip(masks, LENS, strict=True) for v in (m if m is not None else [1] * n)]


def targets_for(gb: GlobalBatch, config: dict, **outputs):
    cfg = msgspec.convert(config, LearnerConfig)
    kwargs = {"prox_logprob": None, "ref_logprob": None, "values": None, **outputs}
    return prepare_targets(
        gb, cfg, kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"), **kwargs
    )


def test_response_mask_is_within_length_and_loss_mask():
    gb = masked_batch()
    assert gb.loss_mask.tolist() == flat_mask()
    mask = response_mask(gb)
    assert mask.shape == (6, 7)
    for row, (m, n) in enumerate(zip(MASKS, LENS, strict=True)):
        expected = (m if m is not None else [1] * n) + [0] * (7 - n)
        assert mask[row].tolist() == expected


def test_a_batch_without_the_column_trains_every_token_and_a_bad_one_is_refused():
    arrow = synthetic_batch(
        vocab_size=50, groups=1, group_size=2, prompt_lens=3, response_lens=[2, 3]
    )
    gb = GlobalBatch.from_arrow(arrow.drop_columns(["loss_mask"]))
    assert gb.loss_mask.tolist() == [1] * 5
    assert response_mask(gb).tolist() == [[1, 1, 0], [1, 1, 1]]
    short = pa.array([[1, 1], [1, 0]], pa.list_(pa.uint8()))
    bad = arrow.set_column(arrow.schema.get_field_index("loss_mask"), "loss_mask", short)
    with pytest.raises(BatchError, match="row 1: loss_mask has 2 entries for 3"):
        GlobalBatch.from_arrow(bad)


def test_global_counts_count_trained_tokens_and_sequences_with_one():
    gb = masked_batch()
    assert gb.trained_lens.tolist() == [4, 5, 3, 0, 3, 4]
    assert global_counts(gb, np.arange(6)) == (19, 5)
    assert global_counts(gb, np.array([2, 3])) == (3, 1)


def test_metrics_keep_total_lengths_add_the_trained_fraction_and_leave_staleness_alone():
    gb = masked_batch(versions=[4, 4, 3, 2, 4, 4])
    metrics = batch_metrics(gb, policy_version=4)
    assert metrics["response_length/mean"] == pytest.approx(sum(LENS) / 6)
    assert metrics["response_length/max"] == 7.0
    assert metrics["perf/response_tokens"] == sum(LENS)
    assert metrics["response/trained_token_fraction"] == pytest.approx(19 / 33)
    # the all-tool row (version 2) still counts for staleness: its tokens were sampled then
    assert metrics["staleness/max"] == 2.0
    assert metrics["staleness/mean"] == pytest.approx((0 + 0 + 1 + 2 + 0 + 0) / 6)
    unmasked = masked_batch(versions=[4, 4, 3, 2, 4, 4], masks=[None] * 6)
    assert batch_metrics(unmasked, 4)["response/trained_token_fraction"] == 1.0


def test_score_goes_on_the_last_trained_token():
    mask = torch.tensor(response_mask(masked_batch()))
    rewards = alg.scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), mask)
    last = [5, 4, 2, None, 4, 4]  # row 2 ends on tool tokens 3..6: its score sits on token 2
    for row, position in enumerate(last):
        expected = [0.0] * 7
        if position is not None:
            expected[position] = float(row + 1)
        assert rewards[row].tolist() == expected, row
    # verl's placement (the last response token) wherever the response ends with a policy token
    for row in (0, 1, 5):
        assert last[row] == LENS[row] - 1


def test_a_response_ending_on_a_tool_reply_keeps_its_reward_through_gae():
    gb = masked_batch()
    values = torch.zeros(6, 7)
    config = {
        "algorithm": {"adv_estimator": "gae", "gamma": 1.0, "lam": 1.0, "whiten_advantages": False},
        "correction": {"mode": "bypass"},
    }
    targets, _ = targets_for(gb, config, values=values)
    mask = targets.mask
    # γ = λ = 1 and V = 0: the return of every trained token is its sequence's score
    expected = torch.tensor(SCORES)[:, None] * mask
    torch.testing.assert_close(targets.returns, expected)
    torch.testing.assert_close(targets.advantages, expected)
    assert targets.returns[2, :3].tolist() == [1.0, 1.0, 1.0]


def test_grpo_broadcasts_over_trained_tokens_and_an_all_tool_row_trains_nothing():
    gb = masked_batch()
    targets, metrics = targets_for(gb, {"correction": {"mode": "bypass"}})
    mask = targets.mask
    assert torch.all(targets.advantages[mask == 0] == 0)
    assert torch.isfinite(targets.advantages).all()
    # group 1 = rows 3..5 with scores 0.25, 1, 0.5: the all-tool row keeps its score in the
    # group's statistics (it is an outcome of the prompt) but has no token to train
    group = torch.tensor(SCORES[3:], dtype=torch.float32)
    expected = (group - group.mean()) / (group.std() + 1e-6)
    assert targets.advantages[4, 0].item() == pytest.approx(expected[1].item(), rel=1e-5)
    assert targets.advantages[5, 0].item() == pytest.approx(expected[2].item(), rel=1e-5)
    assert targets.advantages[3].abs().sum() == 0
    for row in range(6):  # one value per sequence, on its trained tokens only
        assert len(set(targets.advantages[row][mask[row] > 0].tolist())) <= 1
    assert np.isfinite(list(metrics.values())).all()


def test_masked_tokens_take_no_kl_penalty_and_no_importance_weight():
    gb = masked_batch()
    mask = torch.tensor(response_mask(gb), dtype=torch.float64)
    behavior = torch.tensor(padded(gb.behavior_logprobs, gb.response_offsets), dtype=torch.float64)
    assert torch.all(behavior[mask == 0] == 0)  # 0.0 on tool tokens, as the rollout sends them
    prox = torch.where(mask > 0, behavior + 0.1, torch.full_like(mask, -80.0))
    ref = torch.where(mask > 0, prox - 0.2, torch.full_like(mask, 50.0))
    config = {
        "kl": {"use_kl_in_reward": True, "kl_coef": 0.5, "kl_in_reward_kind": "k3"},
        "correction": {"mode": "token_tis", "is_cap": 2.0},
    }
    targets, metrics = targets_for(gb, config, prox_logprob=prox, ref_logprob=ref)
    assert torch.all(targets.is_weights[mask == 0] == 0)
    trained = targets.is_weights[mask > 0]
    torch.testing.assert_close(trained, torch.full_like(trained, float(np.exp(0.1))))
    k3 = float(np.exp(-0.2) + 0.2 - 1)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(k3)  # over the 5 trained rows
    assert metrics["is/behavior_kl"] == pytest.approx(-0.1)
