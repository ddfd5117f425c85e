"""KL estimators, KL controllers, KL-in-reward/KL-in-loss, and logprobs/entropy from
logits: hand values, plain-Python references written here, and gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
)

# ------------------------------------------------------------ KL estimators


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("k1", "kl"), [1.0, -0.5]),
        (("abs",), [1.0, 0.5]),
        (("k2", "mse"), [0.5, 0.125]),
        # exp(−Δ) + Δ − 1: exp(−1) + 0 = 0.367879; exp(0.5) − 1.5 = 0.148721
        (("k3", "low_var_kl"), [math.exp(-1.0), math.exp(0.5) - 1.5]),
    ],
)
def test_kl_penalty_hand_values_and_verl_aliases(kinds, expected):
    logprob = torch.tensor([-1.0, -2.5], dtype=torch.float64)
    ref_logprob = torch.tensor([-2.0, -2.0], dtype=torch.float64)
    for kind in kinds:
        assert kl_penalty(logprob, ref_logprob, kind).tolist() == pytest.approx(expected)


def test_k3_is_clamped_to_ten_and_stays_finite_for_huge_gaps():
    logprob = torch.tensor([-40.0, 0.0, -1.0])
    ref_logprob = torch.tensor([0.0, -40.0, -1.0])
    k3 = kl_penalty(logprob, ref_logprob, "k3")
    # Δ = −40: exp(20) − 21 ≫ 10 -> 10; Δ = +40: exp(−20) + 19 > 10 -> 10; Δ = 0 -> 0
    assert k3.tolist() == pytest.approx([10.0, 10.0, 0.0])


def test_kl_penalty_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown kind 'full'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "full")


def test_kl_loss_equals_aggregated_estimator_and_differentiates_logprob_only():
    logprob = torch.tensor([[-1.0, -2.5, -7.0]], dtype=torch.float64, requires_grad=True)
    ref_logprob = torch.tensor([[-2.0, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss = kl_loss(logprob, ref_logprob, mask, kind="k2", agg_mode="token-mean")
    assert loss.item() == pytest.approx((0.5 + 0.125) / 2)
    loss.backward()
    # d(½Δ²)/dlogprob = Δ, over 2 tokens; padding gets none
    assert logprob.grad[0].tolist() == pytest.approx([0.5, -0.25, 0.0])


# ------------------------------------------------------------ controllers


def test_adaptive_kl_controller_hand_values_and_clipped_error():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    controller.update(current_kl=6.6, n_steps=100)  # error 0.1, not clipped
    assert controller.value == pytest.approx(0.1 * 1.00512 * (1 + 0.1 * 100 / 10000))
    controller.update(current_kl=0.0, n_steps=10000)  # error −1 clipped to −0.2
    assert controller.value == pytest.approx(0.1 * 1.00512 * 1.001 * 0.8)


def test_kl_controllers_restore_their_coefficient_from_state_dict():
    controller = AdaptiveKLController(0.1, 6.0, 100)
    controller.update(12.0, 50)
    restored = AdaptiveKLController(0.1, 6.0, 100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value != 0.1
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.3


def test_adaptive_kl_controller_rejects_non_positive_horizon():
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, 6.0, 0)


# ------------------------------------------------------------ KL in the reward


def test_apply_kl_penalty_to_rewards_hand_values_and_controller_update():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    ref_logprob = torch.full((2, 3), -1.0, dtype=torch.float64)
    logprob = ref_logprob + torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    controller = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=4)
    rewards, metrics = apply_kl_penalty_to_rewards(
        scores, logprob, ref_logprob, mask, controller, "kl"
    )
    expected = [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=torch.float64))
    # per-sequence means 0.2 and 0.45, batch mean 0.325; coefficient reported before update
    assert metrics == pytest.approx(
        {"actor/reward_kl_penalty": 0.325, "actor/reward_kl_penalty_coeff": 0.5}
    )
    assert all(isinstance(v, float) for v in metrics.values())
    # error = clip(3.25 − 1) = 0.2, n = batch size 2, horizon 4: β·(1 + 0.1)
    assert controller.value == pytest.approx(0.55)


# ------------------------------------------------------------ logprobs and entropy


def test_logprobs_from_logits_hand_values_with_temperature():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0)]], dtype=torch.float64)
    labels = torch.tensor([2])
    assert logprobs_from_logits(logits, labels).item() == pytest.approx(math.log(0.5))
    # T = 2: softmax ∝ [1, √2, √3]
    expected = math.log(math.sqrt(3) / (1 + math.sqrt(2) + math.sqrt(3)))
    assert logprobs_from_logits(logits, labels, temperature=2.0).item() == pytest.approx(expected)


def test_entropy_from_logits_hand_value_and_masked_vocabulary():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), float("-inf")]])
    probabilities = [1 / 6, 2 / 6, 3 / 6]
    expected = -sum(p * math.log(p) for p in probabilities)
    assert entropy_from_logits(logits).item() == pytest.approx(expected, rel=1e-6)
    uniform = torch.zeros(2, 3, 5)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(5)))


def _reference_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    rows = logits.double().reshape(-1, logits.shape[-1]).tolist()
    out = []
    for row, label in zip(rows, labels.reshape(-1).tolist(), strict=True):
        scaled = [x / temperature for x in row]
        top = max(scaled)
        log_norm = top + math.log(sum(math.exp(x - top) for x in scaled))
        out.append(scaled[label] - log_norm)
    return torch.tensor(out, dtype=torch.float64).reshape(labels.shape)


@pytest.mark.parametrize("chunk_rows", [1, 4, 1024])
def test_logprobs_and_gradient_match_reference_and_naive_autograd(chunk_rows):
    generator = torch.Generator().manual_seed(21)
    logits = (torch.randn(3, 5, 11, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    token_logprobs = logprobs_from_logits(logits, labels, temperature=0.7, chunk_rows=chunk_rows)
    torch.testing.assert_close(
        token_logprobs.double(), _reference_logprobs(logits.detach(), labels, 0.7)
    )
    upstream = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    (token_logprobs * upstream).sum().backward()
    naive_logits = logits.detach().clone().requires_grad_()
    naive = torch.log_softmax(naive_logits / 0.7, dim=-1).gather(-1, labels[..., None])[..., 0]
    (naive * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, naive_logits.grad, rtol=1e-5, atol=1e-6)


def test_logprobs_bf16_logits_are_computed_in_fp32_with_bf16_gradient():
    generator = torch.Generator().manual_seed(22)
    logits32 = torch.randn(6, 50, generator=generator) * 4
    labels = torch.randint(0, 50, (6,), generator=generator)
    logits16 = logits32.bfloat16().requires_grad_()
    token_logprobs = logprobs_from_logits(logits16, labels, chunk_rows=4)
    assert token_logprobs.dtype == torch.float32
    reference = _reference_logprobs(logits16.detach().float(), labels, 1.0)
    torch.testing.assert_close(token_logprobs.double(), reference, rtol=0, atol=1e-5)
    token_logprobs.sum().backward()
    assert logits16.grad.dtype == torch.bfloat16 and torch.isfinite(logits16.grad.float()).all()


def test_entropy_gradient_flows_and_matches_autograd_of_the_definition():
    generator = torch.Generator().manual_seed(23)
    logits = torch.randn(4, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    naive_logits = logits.detach().clone().requires_grad_()
    log_probs = torch.log_softmax(naive_logits, dim=-1)
    (-(log_probs.exp() * log_probs).sum(-1)).sum().backward()
    torch.testing.assert_close(logits.grad, naive_logits.grad.to(logits.grad.dtype))


def test_no_grad_entropy_is_chunked_with_identical_result():
    generator = torch.Generator().manual_seed(24)
    logits = torch.randn(7, 13, generator=generator)
    with torch.no_grad():
        chunked = entropy_from_logits(logits, chunk_rows=2)
    torch.testing.assert_close(chunked, entropy_from_logits(logits, chunk_rows=100))


def test_logprobs_reject_out_of_range_labels_and_bad_temperature():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        logprobs_from_logits(torch.zeros(2, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(torch.zeros(2, 4), torch.tensor([0, 1]), temperature=0.0)


def test_per_token_temperature_tensor_matches_dividing_each_row_first():
    generator = torch.Generator().manual_seed(25)
    logits = (torch.randn(2, 3, 8, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.randint(0, 8, (2, 3), generator=generator)
    temperature = torch.tensor([[0.5, 0.5, 0.5], [1.3, 1.3, 1.3]], dtype=torch.float64)
    token_logprobs = logprobs_from_logits(logits, labels, temperature=temperature, chunk_rows=2)
    naive_logits = logits.detach().clone().requires_grad_()
    scaled = naive_logits / temperature[..., None]
    naive = torch.log_softmax(scaled, dim=-1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs, naive)
    token_logprobs.sum().backward()
    naive.sum().backward()
    torch.testing.assert_close(logits.grad, naive_logits.grad)
    with torch.no_grad():
        entropy = entropy_from_logits(logits, temperature=temperature, chunk_rows=4)
    naive_entropy = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
    torch.testing.assert_close(entropy, naive_entropy.detach())


def test_temperature_tensor_with_a_non_positive_entry_is_rejected():
    with pytest.raises(ValueError, match="every temperature must be > 0"):
        logprobs_from_logits(torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([1.0, 0.0]))
