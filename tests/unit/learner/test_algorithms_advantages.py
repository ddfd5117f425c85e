"""Advantage estimators and masked statistics: hand-computed values, a plain-Python
reference implementation written here (loops, no learner code), and properties."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from learner.algorithms import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    masked_mean,
    masked_whiten,
    scores_to_token_rewards,
)

# ------------------------------------------------------------ references (plain Python)


def ref_whiten(rows: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    valid = [
        x
        for row, m_row in zip(rows, mask, strict=True)
        for x, m in zip(row, m_row, strict=True)
        if m
    ]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def ref_gae(rewards, values, mask, gamma, lam):
    """GAE over the valid steps of each row only (masked steps removed, then restored as 0)."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        idx = [t for t, m in enumerate(m_row) if m]
        adv_row = [0.0] * len(m_row)
        ret_row = [0.0] * len(m_row)
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = r_row[t] + gamma * next_v - v_row[t]
            next_a = delta + gamma * lam * next_a
            next_v = v_row[t]
            adv_row[t] = next_a
            ret_row[t] = next_a + v_row[t]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def ref_group_advantages(scores, groups, kind, eps=1e-6):
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(members)
        if kind == "grpo":
            if n == 1:
                out.append(s / (1.0 + eps))
            else:
                out.append((s - statistics.mean(members)) / (statistics.stdev(members) + eps))
        elif kind == "drgrpo":
            out.append(s if n == 1 else s - statistics.mean(members))
        else:  # rloo
            out.append(s if n == 1 else s - (sum(members) - s) / (n - 1))
    return out


def random_mask(generator: torch.Generator, batch: int, length: int, holes: bool) -> torch.Tensor:
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    if holes:
        mask = mask * (torch.rand(batch, length, generator=generator, dtype=torch.float64) > 0.25)
        mask[:, 0] = 1.0
    return mask


# ------------------------------------------------------------ masked statistics


def test_masked_mean_ignores_padding_and_all_padding_mean_is_zero():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, mask, dim=-1).tolist() == pytest.approx([2.0, 0.0])


def test_masked_whiten_uses_unbiased_variance_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    # mean 2, unbiased var ((1)+(0)+(1))/2 = 1: padding is transformed too (verl), not used.
    assert masked_whiten(x, mask)[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-7)
    assert masked_whiten(x, mask, shift_mean=False)[0, :3].tolist() == pytest.approx(
        [1.0, 2.0, 3.0], abs=1e-7
    )


def test_masked_whiten_single_element_gives_zero_not_an_error():
    x = torch.tensor([[5.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert masked_whiten(x, mask)[0, 0].item() == 0.0


def test_masked_functions_reject_mismatched_shapes_naming_the_function():
    with pytest.raises(ValueError, match="masked_mean"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))


# ------------------------------------------------------------ token rewards


def test_scores_go_on_the_last_valid_token_including_masks_with_holes():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, -1.0]), mask)
    assert rewards.tolist() == [
        [0.0, 0.0, 1.0, 0.0],
        [0.0, 0.0, 2.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, -1.0],
    ]


def test_scores_to_token_rewards_rejects_wrong_batch_size():
    with pytest.raises(ValueError, match="scores shape"):
        scores_to_token_rewards(torch.zeros(3), torch.ones(2, 4))


# ------------------------------------------------------------ GAE


def test_gae_hand_values_with_padding_and_a_hole():
    rewards = torch.tensor(
        [[0.0, 0.0, 1.0], [0.0, 1.0, 5.0], [0.0, 7.0, 1.0]], dtype=torch.float64
    )  # 5.0 and 7.0 sit on masked steps and must not leak
    values = torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.1, 9.0], [0.5, 9.0, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # row 0: δ2 = 0.7; δ1 = 0.9·0.3 − 0.4 = −0.13, A1 = −0.13 + 0.72·0.7 = 0.374;
    #        δ0 = 0.9·0.4 − 0.5 = −0.14, A0 = −0.14 + 0.72·0.374 = 0.12928
    assert adv[0].tolist() == pytest.approx([0.12928, 0.374, 0.7])
    assert ret[0].tolist() == pytest.approx([0.62928, 0.774, 1.0])
    # row 1: A1 = 1 − 0.1 = 0.9; A0 = 0.9·0.1 − 0.2 + 0.72·0.9 = 0.538; padding 0
    assert adv[1].tolist() == pytest.approx([0.538, 0.9, 0.0])
    assert ret[1].tolist() == pytest.approx([0.738, 1.0, 0.0])
    # row 2: step 1 is transparent: A2 = 0.7; A0 = 0.9·0.3 − 0.5 + 0.72·0.7 = 0.274
    assert adv[2].tolist() == pytest.approx([0.274, 0.0, 0.7])


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference_on_random_batches(holes):
    generator = torch.Generator().manual_seed(1 + holes)
    mask = random_mask(generator, 6, 9, holes)
    rewards = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    values = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.97, lam=0.9, whiten=True)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.9)
    ref_white = ref_whiten(ref_adv, mask.tolist())
    expected = torch.tensor(ref_white, dtype=torch.float64) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


def test_gae_with_gamma_lambda_one_and_zero_values_is_reward_to_go():
    generator = torch.Generator().manual_seed(3)
    mask = random_mask(generator, 4, 7, holes=False)
    rewards = torch.randn(4, 7, generator=generator, dtype=torch.float64) * mask
    adv, ret = compute_gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0, whiten=False)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(adv, reward_to_go)
    torch.testing.assert_close(ret, reward_to_go)


# ------------------------------------------------------------ REINFORCE++


def test_reinforce_pp_hand_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    adv = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # returns [0.25, 0.5, 1 | 0.5, 1]: mean 0.65, unbiased var 0.45/4 = 0.1125
    std = math.sqrt(0.1125)
    expected = [[-0.4 / std, -0.15 / std, 0.35 / std], [-0.15 / std, 0.35 / std, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_reinforce_pp_matches_reference_whitened_reward_to_go():
    generator = torch.Generator().manual_seed(4)
    mask = random_mask(generator, 5, 8, holes=False)
    rewards = torch.randn(5, 8, generator=generator, dtype=torch.float64) * mask
    gamma = 0.9
    returns = []
    for r_row, m_row in zip(rewards.tolist(), mask.tolist(), strict=True):
        row = [0.0] * len(r_row)
        for t in range(len(r_row)):
            if m_row[t]:
                row[t] = sum(gamma ** (k - t) * r_row[k] for k in range(t, len(r_row)) if m_row[k])
        returns.append(row)
    expected = torch.tensor(ref_whiten(returns, mask.tolist()), dtype=torch.float64) * mask
    torch.testing.assert_close(compute_reinforce_pp_advantages(rewards, mask, gamma), expected)


def test_reinforce_pp_masked_step_restarts_the_return_as_verl():
    # verl's reinforce_plus_plus on this batch (the second row all zeros): the return
    # at t=0 does not see the reward at t=2 across the masked step t=1.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.float64)
    adv = compute_reinforce_pp_advantages(rewards, mask, gamma=1.0)
    expected = [[-1 / math.sqrt(5), 0.0, 4 / math.sqrt(5)], [-1 / math.sqrt(5)] * 3]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=0)
    single = compute_reinforce_pp_advantages(rewards[:1], mask[:1], gamma=1.0)
    torch.testing.assert_close(
        single, torch.tensor([[-math.sqrt(0.5), 0.0, math.sqrt(0.5)]], dtype=torch.float64)
    )


def test_reinforce_pp_with_holes_matches_verls_recurrence():
    generator = torch.Generator().manual_seed(5)
    mask = random_mask(generator, 5, 9, holes=True)
    rewards = torch.randn(5, 9, generator=generator, dtype=torch.float64)
    gamma = 0.9
    returns = []
    for r_row, m_row in zip(rewards.tolist(), mask.tolist(), strict=True):
        row, running = [0.0] * len(r_row), 0.0
        for t in reversed(range(len(r_row))):
            running = r_row[t] + gamma * running
            row[t] = running
            running *= m_row[t]
        returns.append(row)
    expected = torch.tensor(ref_whiten(returns, mask.tolist()), dtype=torch.float64) * mask
    torch.testing.assert_close(compute_reinforce_pp_advantages(rewards, mask, gamma), expected)


# ------------------------------------------------------------ GRPO / Dr. GRPO / RLOO


def test_grpo_hand_values_with_string_group_ids():
    scores = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    groups = ["a", "a", "b", "b", "b", "c"]
    mask = torch.tensor([[1, 1]] * 5 + [[1, 0]], dtype=torch.float64)
    adv = compute_grpo_advantages(scores, groups, mask)
    # a: mean .5, unbiased std sqrt(.5); b: mean 1, std 1; c: singleton -> mean 0, std 1
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    expected = [[a, a], [-a, -a], [b, b], [-b, -b], [0.0, 0.0], [3 / (1 + 1e-6), 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_dr_grpo_does_not_divide_by_std():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = compute_grpo_advantages(scores, [0, 0, 0, 0], torch.ones(4, 1), norm_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_hand_values_equal_score_minus_mean_of_others():
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0])
    adv = compute_rloo_advantages(scores, torch.tensor([7, 7, 7, 9]), torch.ones(4, 2))
    # group 7: n/(n−1)·(r − 1) = 1.5·[0, −1, 1]; group 9 is a singleton: raw score (verl)
    assert adv[:, 0].tolist() == pytest.approx([0.0, -1.5, 1.5, 5.0])


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("ids_as", ["tensor", "list", "numpy_str"])
def test_group_advantages_match_reference(kind, ids_as):
    generator = torch.Generator().manual_seed(5)
    groups = [3, 3, 3, 3, 8, 8, 1, 5, 5, 5]
    scores = torch.randint(0, 4, (10,), generator=generator).double()
    mask = random_mask(generator, 10, 6, holes=True)
    ids = {
        "tensor": torch.tensor(groups),
        "list": groups,
        "numpy_str": np.array([f"uid-{g}" for g in groups], dtype=object),
    }[ids_as]
    if kind == "rloo":
        adv = compute_rloo_advantages(scores, ids, mask)
    else:
        adv = compute_grpo_advantages(scores, ids, mask, norm_by_std=kind == "grpo")
    expected = torch.tensor(
        ref_group_advantages(scores.tolist(), groups, kind), dtype=torch.float64
    )
    torch.testing.assert_close(adv, expected[:, None] * mask)


def test_grpo_zero_variance_group_gives_exactly_zero_advantage_in_float32():
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.1, 0.2], dtype=torch.float32)
    groups = ["x", "x", "x", "y", "y", "y", "z", "z"]
    adv = compute_grpo_advantages(scores, groups, torch.ones(8, 3))
    assert torch.all(adv[:6] == 0.0)
    assert torch.all(adv[6:] != 0.0)
    rloo = compute_rloo_advantages(scores, groups, torch.ones(8, 3))
    assert torch.all(rloo[:6] == 0.0)


def test_group_ids_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="group_ids has 2 entries for a batch of 3"):
        compute_grpo_advantages(torch.zeros(3), ["a", "b"], torch.ones(3, 2))
