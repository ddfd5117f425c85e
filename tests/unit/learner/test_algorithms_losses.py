"""Loss aggregation, PPO policy loss, value loss and importance weights: hand values,
plain-Python references written here, and the properties the learner relies on
(split invariance of the aggregation, detached weights, dual clip on A < 0 only)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_importance_weights,
    policy_loss,
    value_loss,
)

# ------------------------------------------------------------ references (plain Python)


def ref_agg(loss, mask, mode, scale=None):
    seqs = [
        [x for x, m in zip(row, m_row, strict=True) if m]
        for row, m_row in zip(loss, mask, strict=True)
        if any(m_row)
    ]
    if mode == "token-mean":
        tokens = [x for seq in seqs for x in seq]
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(seq) for seq in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(seq) / len(seq) for seq in seqs) / len(seqs)
    # seq-mean-token-sum-norm (Dr. GRPO): the sequence mean of token sums over a constant
    return (
        sum(sum(seq) for seq in seqs) / len(seqs) / (scale if scale is not None else len(loss[0]))
    )


def ref_policy_token_losses(logprob, old, adv, low, high, c, weights=None):
    out = []
    for i, row in enumerate(logprob):
        out_row = []
        for t, lp in enumerate(row):
            ratio = math.exp(max(-20.0, min(20.0, lp - old[i][t])))
            a = adv[i][t]
            loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
            if c is not None and a < 0:
                loss = min(loss, -c * a)
            out_row.append(loss * (weights[i][t] if weights is not None else 1.0))
        out.append(out_row)
    return out


def make_mask(lengths: list[int], length: int) -> torch.Tensor:
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).double()


# ------------------------------------------------------------ agg_loss


def test_agg_loss_hand_values_and_empty_rows_are_not_sequences():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # Dr. GRPO: token sums 6 and 4 over 2 sequences, over the constant (T = 3 unless given)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 2 / 3)
    assert agg_loss(
        loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=5.0
    ).item() == pytest.approx(1.0)
    assert agg_loss(
        loss, mask, "seq-mean-token-sum-norm", global_seq_count=4, loss_scale_factor=5.0
    ).item() == pytest.approx(0.5)
    assert agg_loss(loss, mask, "token-mean", global_token_count=20).item() == pytest.approx(0.5)
    assert agg_loss(loss, mask, "seq-mean-token-mean", global_seq_count=6).item() == pytest.approx(
        1
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_reference(mode):
    generator = torch.Generator().manual_seed(11)
    loss = torch.randn(7, 9, generator=generator, dtype=torch.float64)
    mask = make_mask([9, 1, 4, 0, 6, 2, 8], 9)
    expected = ref_agg(loss.tolist(), mask.tolist(), mode)
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected)


def test_agg_loss_rejects_unknown_mode_listing_the_accepted_ones():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "token-sum")


def _split_grad_and_loss(features, targets, mask, mode, dp_size, micro_per_rank, use_global):
    """Simulated data-parallel step: each rank sums its micro-batch gradients, then
    FSDP averages over ranks. Returns (averaged grad of the shared weight, logged loss)."""
    rows = features.shape[0]
    rank_rows = rows // dp_size
    micro_rows = rank_rows // micro_per_rank
    token_count = mask.sum()
    seq_count = (mask.sum(-1) > 0).sum()
    rank_grads, rank_losses = [], []
    for rank in range(dp_size):
        weight = torch.zeros(features.shape[-1], dtype=torch.float64, requires_grad=True)
        logged = 0.0
        for micro in range(micro_per_rank):
            start = rank * rank_rows + micro * micro_rows
            part = slice(start, start + micro_rows)
            logprob = features[part] @ weight - 1.0
            advantages = targets[part]
            kwargs = {"loss_agg_mode": mode, "loss_scale_factor": 16.0}
            if use_global:
                kwargs |= {
                    "global_token_count": token_count,
                    "global_seq_count": seq_count,
                    "dp_size": dp_size,
                }
            loss, _ = policy_loss(
                logprob, torch.full_like(logprob, -1.1), advantages, mask[part], **kwargs
            )
            loss.backward()  # gradient accumulation: summed over micro-batches
            logged += loss.item()
        rank_grads.append(weight.grad.clone())
        rank_losses.append(logged)
    return torch.stack(rank_grads).mean(0), sum(rank_losses) / dp_size


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_with_global_counts_is_invariant_to_a_2_rank_2_micro_batch_split(mode):
    generator = torch.Generator().manual_seed(12)
    features = torch.randn(8, 10, 3, generator=generator, dtype=torch.float64) * 0.3
    targets = torch.randn(8, 10, generator=generator, dtype=torch.float64)
    mask = make_mask([10, 1, 3, 0, 7, 2, 9, 5], 10)  # unequal tokens per micro-batch and rank

    full_grad, full_loss = _split_grad_and_loss(features, targets, mask, mode, 1, 1, False)
    split_grad, split_loss = _split_grad_and_loss(features, targets, mask, mode, 2, 2, True)
    torch.testing.assert_close(split_grad, full_grad)
    assert split_loss == pytest.approx(full_loss)

    naive_grad, _ = _split_grad_and_loss(features, targets, mask, mode, 2, 2, False)
    assert not torch.allclose(naive_grad, full_grad), "the split must matter without counts"


def test_agg_loss_rejects_bad_counts_and_dp_size():
    with pytest.raises(ValueError, match="global_token_count must be >= 0"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "token-mean", global_token_count=-1)
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "token-mean", dp_size=0)


# ------------------------------------------------------------ policy loss


def test_policy_loss_hand_values_metrics_and_gradient():
    old = torch.zeros(1, 5, dtype=torch.float64)
    logprob = torch.tensor(
        [[math.log(1.5), math.log(0.5), math.log(5.0), 0.0, 3.0]], dtype=torch.float64
    ).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 2.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, metrics = policy_loss(logprob, old, advantages, mask)
    # token 1: clipped to 1.2 -> −1.2; token 2: clipped to 0.8 -> 0.8;
    # token 3: max(5, 1.2) = 5 -> dual clip min(5, 3) = 3; token 4: −2; token 5 is padding
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 2.0) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    assert metrics["ppo_kl"].item() == pytest.approx(
        -(math.log(1.5) + math.log(0.5) + math.log(5)) / 4
    )
    assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    # only token 4 is unclipped: d(−A·r)/dlogprob = −A·r = −2, over 4 tokens
    assert logprob.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5, 0.0])


@pytest.mark.parametrize("clip_c", [3.0, None])
def test_policy_loss_matches_reference_with_asymmetric_clip_and_is_weights(clip_c):
    generator = torch.Generator().manual_seed(13)
    logprob = torch.randn(5, 7, generator=generator, dtype=torch.float64) * 0.5 - 1
    old = logprob + torch.randn(5, 7, generator=generator, dtype=torch.float64) * 0.4
    advantages = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    weights = torch.rand(5, 7, generator=generator, dtype=torch.float64) * 2
    mask = make_mask([7, 3, 1, 6, 4], 7)
    loss, _ = policy_loss(
        logprob, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_ratio_c=clip_c, is_weights=weights,
    )  # fmt: skip
    per_token = ref_policy_token_losses(
        logprob.tolist(), old.tolist(), advantages.tolist(), 0.2, 0.28, clip_c, weights.tolist()
    )
    assert loss.item() == pytest.approx(ref_agg(per_token, mask.tolist(), "token-mean"))


def test_dual_clip_only_changes_tokens_with_negative_advantage():
    generator = torch.Generator().manual_seed(14)
    logprob = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 2
    old = torch.zeros(4, 6, dtype=torch.float64)
    advantages = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    positive = (advantages > 0).double()
    negative = (advantages < 0).double()
    with_dual, _ = policy_loss(logprob, old, advantages, positive, clip_ratio_c=3.0)
    without_dual, _ = policy_loss(logprob, old, advantages, positive, clip_ratio_c=None)
    assert with_dual.item() == pytest.approx(without_dual.item())
    neg_dual, metrics = policy_loss(logprob, old, advantages, negative, clip_ratio_c=3.0)
    neg_plain, _ = policy_loss(logprob, old, advantages, negative, clip_ratio_c=None)
    assert metrics["pg_clipfrac_lower"].item() > 0  # the data does trigger the dual clip
    assert neg_dual.item() < neg_plain.item()


def test_policy_loss_ratio_clamp_keeps_loss_and_gradient_finite():
    logprob = torch.tensor([[100.0, -100.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    loss, metrics = policy_loss(
        logprob, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), clip_ratio_c=None
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprob.grad).all()
    assert loss.item() == pytest.approx((math.exp(20.0) - math.exp(-20.0)) / 2, rel=1e-6)
    assert torch.isfinite(metrics["ppo_kl"])


def test_policy_loss_is_weights_are_not_differentiated():
    logprob = torch.zeros(1, 3, requires_grad=True)
    weights = torch.tensor([[0.5, 1.0, 2.0]], requires_grad=True)
    loss, _ = policy_loss(
        logprob, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), is_weights=weights
    )
    loss.backward()
    assert weights.grad is None
    assert logprob.grad[0].tolist() == pytest.approx([-0.5 / 3, -1.0 / 3, -2.0 / 3])


def test_policy_loss_rejects_dual_clip_at_or_below_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 2),
            clip_ratio_c=1.0,
        )


# ------------------------------------------------------------ value loss


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 2.0, 5.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # token 1: clip(1, 0.3, 0.7) = 0.7: max(1, 1.69) = 1.69; token 2: 4; mean 2.845, ×½
    assert loss.item() == pytest.approx(0.5 * (1.69 + 4.0) / 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # token 1 uses the clipped (constant) value: no gradient; token 2: ½·2·(2 − 0)/2 = 1
    assert values.grad[0].tolist() == pytest.approx([0.0, 1.0, 0.0])


# ------------------------------------------------------------ importance weights

LOG_RATIOS = [[math.log(3.0), math.log(0.25), math.log(1.5), 0.7]]
IS_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected", "masked", "clipped"),
    [
        ("bypass", {}, [1.0, 1.0, 1.0, 0.0], 0.0, 0.0),
        ("decoupled", {}, [3.0, 0.25, 1.5, 0.0], 0.0, 0.0),
        ("decoupled", {"decoupled_cap": 2.0}, [0.0, 0.25, 1.5, 0.0], 1 / 3, 0.0),
        ("token_tis", {"cap": 2.0}, [2.0, 0.25, 1.5, 0.0], 0.0, 1 / 3),
        ("token_mis", {"low": 0.5, "high": 2.0}, [0.0, 0.0, 1.5, 0.0], 2 / 3, 0.0),
        ("seq_tis", {"cap": 2.0}, [1.125, 1.125, 1.125, 0.0], 0.0, 0.0),
        ("seq_tis", {"cap": 1.0}, [1.0, 1.0, 1.0, 0.0], 0.0, 1.0),
        ("seq_tis_geo", {"cap": 2.0}, [1.125 ** (1 / 3)] * 3 + [0.0], 0.0, 0.0),
        ("seq_mis", {"low": 0.5, "high": 2.0}, [1.125, 1.125, 1.125, 0.0], 0.0, 0.0),
        ("seq_mis", {"low": 0.5, "high": 1.1}, [0.0, 0.0, 0.0, 0.0], 1.0, 0.0),
        ("seq_mis_geo", {"low": 0.5, "high": 1.1}, [1.125 ** (1 / 3)] * 3 + [0.0], 0.0, 0.0),
    ],
)
def test_importance_weights_hand_values(mode, kwargs, expected, masked, clipped):
    behavior = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    proximal = behavior + torch.tensor(LOG_RATIOS, dtype=torch.float64)
    weights, metrics = compute_importance_weights(proximal, behavior, IS_MASK, mode, **kwargs)
    assert weights[0].tolist() == pytest.approx(expected)
    assert metrics["is_masked_frac"].item() == pytest.approx(masked)
    assert metrics["is_clipped_frac"].item() == pytest.approx(clipped)
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(expected[:3]) / 3)
    assert metrics["is_weight_max"].item() == pytest.approx(max(expected[:3]))
    assert metrics["behavior_kl"].item() == pytest.approx(-sum(LOG_RATIOS[0][:3]) / 3)


def test_importance_weights_match_reference_per_token_and_per_sequence():
    generator = torch.Generator().manual_seed(15)
    behavior = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    proximal = behavior + torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.5
    mask = make_mask([6, 2, 5, 1], 6)
    log_ratios = (proximal - behavior).tolist()
    mask_rows = mask.tolist()
    token_tis, _ = compute_importance_weights(proximal, behavior, mask, "token_tis", cap=1.5)
    seq_mis, _ = compute_importance_weights(proximal, behavior, mask, "seq_mis", low=0.6, high=1.6)
    for i, (row, m_row) in enumerate(zip(log_ratios, mask_rows, strict=True)):
        seq_ratio = math.exp(sum(d for d, m in zip(row, m_row, strict=True) if m))
        for t, (d, m) in enumerate(zip(row, m_row, strict=True)):
            assert token_tis[i, t].item() == pytest.approx(min(math.exp(d), 1.5) * m)
            keep = 0.6 <= seq_ratio <= 1.6
            assert seq_mis[i, t].item() == pytest.approx((seq_ratio if keep else 0.0) * m)


@pytest.mark.parametrize("mode", ["decoupled", "token_tis", "seq_tis", "seq_mis_geo"])
def test_importance_weights_are_detached(mode):
    proximal = torch.randn(2, 3, requires_grad=True)
    behavior = torch.randn(2, 3, requires_grad=True)
    weights, metrics = compute_importance_weights(proximal, behavior, torch.ones(2, 3), mode)
    assert not weights.requires_grad and weights.grad_fn is None
    assert not any(v.requires_grad for v in metrics.values())


def test_importance_weights_extreme_log_ratio_is_finite():
    behavior = torch.tensor([[-200.0, 0.0]])
    proximal = torch.tensor([[0.0, -200.0]])
    weights, metrics = compute_importance_weights(proximal, behavior, torch.ones(1, 2), "decoupled")
    assert torch.isfinite(weights).all() and weights[0, 0].item() == pytest.approx(math.exp(20))
    assert all(torch.isfinite(v) for v in metrics.values())


def test_importance_weights_reject_unknown_mode_and_bad_bounds():
    with pytest.raises(ValueError, match="unknown mode 'tis'"):
        compute_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "tis")
    with pytest.raises(ValueError, match="low <= high"):
        compute_importance_weights(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token_mis", low=2, high=1
        )
