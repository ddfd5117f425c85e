"""The Bradley-Terry loss against the plain formula, its margin, gradients and normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from learner.bradley_terry import bradley_terry_loss, pair_losses, pair_metrics


def _reference(chosen: list[float], rejected: list[float], margin: list[float]) -> float:
    """-mean log σ(r_c - r_r - m), written out by hand."""
    total = 0.0
    for c, r, m in zip(chosen, rejected, margin, strict=True):
        total += -math.log(1.0 / (1.0 + math.exp(-(c - r - m))))
    return total / len(chosen)


CHOSEN = [1.5, -0.2, 0.3, 2.0]
REJECTED = [0.5, 0.4, 0.3, -1.0]
MARGIN = [0.0, 0.5, 1.0, 0.25]


def test_loss_equals_the_plain_formula_with_and_without_margin():
    c, r, m = (torch.tensor(x, dtype=torch.float64) for x in (CHOSEN, REJECTED, MARGIN))
    got = bradley_terry_loss(c, r, m, global_pair_count=4)
    assert float(got) == pytest.approx(_reference(CHOSEN, REJECTED, MARGIN), rel=1e-12)
    plain = bradley_terry_loss(c, r, None, global_pair_count=4)
    assert float(plain) == pytest.approx(_reference(CHOSEN, REJECTED, [0.0] * 4), rel=1e-12)
    # the margin asks for more: the same scores lose more with it
    assert float(got) > float(plain)


def test_gradients_are_the_formula_s_and_stay_finite_for_huge_differences():
    c = torch.tensor([1000.0, -1000.0, 0.0], requires_grad=True)
    r = torch.tensor([-1000.0, 1000.0, 0.0], requires_grad=True)
    loss = bradley_terry_loss(c, r, None, global_pair_count=3)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(c.grad).all() and torch.isfinite(r.grad).all()
    # d/dc of -log σ(c - r) / 3 = -(1 - σ(c - r)) / 3
    expected = -(1 - torch.sigmoid(torch.tensor([2000.0, -2000.0, 0.0]))) / 3
    torch.testing.assert_close(c.grad, expected)
    torch.testing.assert_close(r.grad, -expected)
    assert float(pair_losses(torch.tensor([-1000.0]), torch.tensor([1000.0]))) == pytest.approx(2000.0)  # fmt: skip


def test_micro_batch_and_rank_shares_sum_to_the_global_mean():
    c, r, m = (torch.tensor(x) for x in (CHOSEN, REJECTED, MARGIN))
    whole = bradley_terry_loss(c, r, m, global_pair_count=4)
    # two ranks (dp_size 2) with two micro-batches each: FSDP averages over the ranks
    shares = [
        bradley_terry_loss(c[i : i + 1], r[i : i + 1], m[i : i + 1], global_pair_count=4, dp_size=2)
        for i in range(4)
    ]
    assert float(sum(shares)) / 2 == pytest.approx(float(whole), rel=1e-6)


def test_metrics_count_ties_as_wrong_and_give_the_score_difference():
    m = pair_metrics(torch.tensor(CHOSEN), torch.tensor(REJECTED), torch.tensor(MARGIN))
    assert m["acc"].tolist() == [1.0, 0.0, 0.0, 1.0]  # pair 2 is a tie
    torch.testing.assert_close(m["margin"], torch.tensor(CHOSEN) - torch.tensor(REJECTED))
    assert float(m["loss"].mean()) == pytest.approx(_reference(CHOSEN, REJECTED, MARGIN), rel=1e-6)
