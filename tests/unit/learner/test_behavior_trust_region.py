"""The decoupled loss's trust region around the behaviour policy (``policy_loss(behavior_logprob=)``).

What it must do: with one mini-batch per step (π_θ = π_prox, r = 1) its loss and
gradient equal the bypass loss's; with fresh data (π_prox = π_behav, w = 1) it
never changes the PPO loss; a token the cap masked (w = 0) stays out; tokens
past the bound get no gradient. Checked by hand values, by a plain-Python
reference, and against the bypass loss itself. Also: ``prepare_targets`` hands
π_behav to the loss exactly for the decoupled mode with the flag on.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from learner.algorithms import policy_loss
from learner.batching import GlobalBatch
from learner.config import LearnerConfig
from learner.prepare import make_kl_controller, prepare_targets
from learner.synthetic import synthetic_batch


def ref_token_losses(logprob, prox, behavior, adv, weights, low, high, c):
    """Plain Python: w·PPO(r) with the dual clip, then the behaviour bound where w > 0."""
    out = []
    for i, row in enumerate(logprob):
        out_row = []
        for t, lp in enumerate(row):
            a, w = adv[i][t], weights[i][t]
            r = math.exp(max(-20.0, min(20.0, lp - prox[i][t])))
            loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if c is not None and a < 0:
                loss = min(loss, -c * a)
            loss *= w
            rho = math.exp(max(-20.0, min(20.0, lp - behavior[i][t])))
            past = (a > 0 and rho > 1 + high) or (a < 0 and rho < 1 - low)
            if w > 0 and past:
                loss = max(loss, -a * min(max(rho, 1 - low), 1 + high))
            out_row.append(loss)
        out.append(out_row)
    return out


def test_hand_values_gradient_and_metric_at_r_equal_one():
    # r = 1 on every token; w = π_prox/π_behav = [3, 0.5, 1.1, 0.5, 3, 0 (masked by the cap)]
    prox = torch.zeros(1, 6, dtype=torch.float64)
    logprob = prox.clone().requires_grad_()
    rho = [3.0, 0.5, 1.1, 0.5, 3.0, 6.0]
    behavior = -torch.tensor([[math.log(x) for x in rho]], dtype=torch.float64)
    weights = torch.tensor([[3.0, 0.5, 1.1, 0.5, 3.0, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, metrics = policy_loss(
        logprob, prox, advantages, torch.ones(1, 6, dtype=torch.float64),
        is_weights=weights, behavior_logprob=behavior,
    )  # fmt: skip
    # t0: A > 0 past 1.2 -> −1.2 (constant); t1: −0.5; t2: inside -> −1.1;
    # t3: A < 0 below 0.8 -> 0.8 (constant); t4: A < 0 above: not its side -> 3; t5: w = 0
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.1 + 0.8 + 3.0 + 0.0) / 6)
    assert metrics["pg_clipfrac_behavior"].item() == pytest.approx(2 / 6)
    assert metrics["pg_clipfrac"].item() == 0.0  # the π_prox clip never binds at r = 1
    loss.backward()
    assert logprob.grad[0].tolist() == pytest.approx([0.0, -0.5 / 6, -1.1 / 6, 0.0, 3.0 / 6, 0.0])


@pytest.mark.parametrize("clip_c", [3.0, None])
def test_matches_the_plain_python_reference(clip_c):
    generator = torch.Generator().manual_seed(31)
    shape = (6, 9)
    logprob = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5 - 1
    prox = logprob + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.3
    behavior = prox + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.6
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    weights = torch.exp(prox - behavior)
    weights = torch.where(weights > 2.5, torch.zeros_like(weights), weights)  # a cap
    mask = torch.ones(shape, dtype=torch.float64)
    loss, metrics = policy_loss(
        logprob, prox, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_ratio_c=clip_c, is_weights=weights, behavior_logprob=behavior,
    )  # fmt: skip
    expected = ref_token_losses(
        logprob.tolist(), prox.tolist(), behavior.tolist(), advantages.tolist(),
        weights.tolist(), 0.2, 0.28, clip_c,
    )  # fmt: skip
    flat = [x for row in expected for x in row]
    assert loss.item() == pytest.approx(sum(flat) / len(flat))
    assert 0 < metrics["pg_clipfrac_behavior"].item() < 1  # the data does reach the bound


def test_one_mini_batch_equals_the_bypass_loss_value_and_gradient():
    generator = torch.Generator().manual_seed(32)
    shape = (5, 7)
    prox = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5 - 1
    behavior = prox + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = (torch.rand(shape, generator=generator) > 0.2).double()
    weights = torch.exp(prox - behavior) * mask  # uncapped decoupled weights
    decoupled_lp = prox.clone().requires_grad_()  # π_θ = π_prox: the step's first update
    decoupled, _ = policy_loss(
        decoupled_lp, prox, advantages, mask, clip_ratio_c=None,
        is_weights=weights, behavior_logprob=behavior,
    )  # fmt: skip
    bypass_lp = prox.clone().requires_grad_()
    bypass, _ = policy_loss(bypass_lp, behavior, advantages, mask, clip_ratio_c=None)
    assert decoupled.item() == pytest.approx(bypass.item())
    decoupled.backward()
    bypass.backward()
    assert torch.allclose(decoupled_lp.grad, bypass_lp.grad)
    plain_lp = prox.clone().requires_grad_()
    plain, _ = policy_loss(plain_lp, prox, advantages, mask, clip_ratio_c=None, is_weights=weights)
    plain.backward()
    assert not torch.allclose(plain_lp.grad, decoupled_lp.grad)  # the bound did bind


def test_fresh_data_leaves_the_ppo_loss_unchanged():
    generator = torch.Generator().manual_seed(33)
    shape = (4, 8)
    logprob = (torch.randn(shape, generator=generator, dtype=torch.float64) - 1).requires_grad_()
    prox = logprob.detach() + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.float64)
    ones = torch.ones(shape, dtype=torch.float64)
    with_bound, metrics = policy_loss(
        logprob, prox, advantages, mask, is_weights=ones, behavior_logprob=prox
    )
    (grad_with,) = torch.autograd.grad(with_bound, logprob)
    without, plain_metrics = policy_loss(logprob, prox, advantages, mask, is_weights=ones)
    (grad_without,) = torch.autograd.grad(without, logprob)
    assert plain_metrics["pg_clipfrac"].item() > 0  # r is away from 1: the PPO clip binds
    assert with_bound.item() == pytest.approx(without.item())
    assert torch.allclose(grad_with, grad_without)
    assert metrics["pg_clipfrac_behavior"].item() == 0.0


def test_behavior_logprob_shape_is_checked():
    with pytest.raises(ValueError, match="behavior_logprob shape"):
        policy_loss(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3),
            behavior_logprob=torch.zeros(2, 2),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("correction", "handed"),
    [
        ({"mode": "decoupled"}, False),  # off by default: AReaL's decoupled loss
        ({"mode": "decoupled", "decoupled_behavior_clip": True}, True),
        ({"mode": "token_tis"}, False),
        ({"mode": "bypass"}, False),
    ],
)
def test_prepare_targets_hands_behavior_logprobs_only_to_the_decoupled_bound(correction, handed):
    gb = GlobalBatch.from_arrow(
        synthetic_batch(
            vocab_size=50, groups=2, group_size=2, prompt_lens=3,
            response_lens=[2, 3, 1, 4], token_versions=0, seed=2,
        )
    )  # fmt: skip
    cfg = msgspec.convert({"correction": correction}, LearnerConfig)
    prox = None
    if correction["mode"] != "bypass":
        prox = torch.zeros(4, 4, dtype=torch.float32)
    targets, _ = prepare_targets(
        gb, cfg, prox_logprob=prox, ref_logprob=None, values=None,
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
    )  # fmt: skip
    if not handed:
        assert targets.behavior_logprob is None
        return
    assert targets.behavior_logprob is not None
    assert targets.behavior_logprob[3, :4].tolist() == pytest.approx(
        gb.behavior_logprobs[6:10].tolist()
    )
