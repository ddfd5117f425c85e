"""Losses and gradients under multi-turn loss masks, against a per-token reference.

The reference walks the trained tokens (loss mask 1) one by one in plain Python
and torch scalars, so it never sees a masked token. The learner's tensors hold
deliberately hostile values on masked tokens (behaviour logprob 0.0 or 50.0,
policy logprob −80 or −inf): neither the loss nor any gradient may change.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import msgspec
import numpy as np
import pytest
import torch

from learner import algorithms as alg
from learner.batching import GlobalBatch, global_counts, padded
from learner.config import LearnerConfig
from learner.prepare import make_kl_controller, prepare_targets
from tests.unit.learner.test_loss_mask_targets import LENS, SCORES, masked_batch

CLIP_LOW, CLIP_HIGH, CLIP_C, CAP = 0.2, 0.2, 3.0, 5.0
GRPO_CONFIG = {
    "correction": {"mode": "decoupled", "decoupled_cap": CAP, "decoupled_behavior_clip": True},
    "kl": {"use_kl_in_reward": True, "kl_coef": 0.05, "kl_in_reward_kind": "k1"},
}
GAE_CONFIG = {
    "algorithm": {"adv_estimator": "gae", "gamma": 0.9, "lam": 0.8, "whiten_advantages": True},
    "correction": {"mode": "bypass"},
}
KL_LOSS_COEF, CLIP_VALUE = 0.1, 0.2


def hostile(gb: GlobalBatch, tensors: dict[str, torch.Tensor], fills: dict[str, float]):
    """The batch with masked tokens' behaviour logprobs set to 50.0, and ``tensors`` with
    their masked entries replaced by ``fills``."""
    behavior = np.where(gb.loss_mask == 0, 50.0, gb.behavior_logprobs).astype(np.float32)
    changed = dataclasses.replace(gb, behavior_logprobs=behavior)
    lens = torch.tensor(gb.response_lens)
    within = torch.arange(max(LENS))[None, :] < lens[:, None]
    masked = within & (torch.tensor(padded(gb.loss_mask, gb.response_offsets)) == 0)
    out = {
        name: torch.where(masked, torch.full_like(t, fills[name]), t) if name in fills else t
        for name, t in tensors.items()
    }
    return changed, out


def random_logprobs(gb: GlobalBatch, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    behavior = torch.tensor(padded(gb.behavior_logprobs, gb.response_offsets), dtype=torch.float64)
    shape = behavior.shape

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(shape, generator=generator, dtype=torch.float64)

    prox = behavior + noise(0.4)
    return {
        "prox": prox,
        "logprob": prox + noise(0.3),
        "ref": prox + noise(0.2),
        "values": noise(1.0),
        "new_values": noise(1.0),
    }


def trained_positions(gb: GlobalBatch) -> list[list[int]]:
    mask = padded(gb.loss_mask, gb.response_offsets)
    return [[int(t) for t in np.flatnonzero(mask[i])] for i in range(gb.size)]


def aggregate(per_token: dict[int, list[torch.Tensor]], mode: str) -> torch.Tensor:
    """token-mean or seq-mean-token-mean over the rows' trained-token terms."""
    rows = [terms for terms in per_token.values() if terms]
    if mode == "token-mean":
        return sum(sum(terms) for terms in rows) / sum(len(terms) for terms in rows)
    return sum(sum(terms) / len(terms) for terms in rows) / len(rows)


def ppo_term(logprob, old, advantage: float, weight: float = 1.0, behavior=None):
    """One trained token's clipped, dual-clipped, weighted PPO term (+ behaviour bound)."""
    ratio = torch.exp(logprob - old)
    term = torch.maximum(
        -advantage * ratio, -advantage * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    )
    if advantage < 0:
        term = torch.minimum(term, torch.tensor(-CLIP_C * advantage, dtype=term.dtype))
    term = term * weight
    if behavior is not None and weight > 0:
        rho = math.exp(logprob.item() - behavior)
        if (advantage > 0 and rho > 1 + CLIP_HIGH) or (advantage < 0 and rho < 1 - CLIP_LOW):
            bound = -advantage * min(max(rho, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            if bound > term.item():
                term = torch.tensor(bound, dtype=term.dtype)
    return term


def reference_grpo(gb: GlobalBatch, lp: dict[str, torch.Tensor], logprob, mode: str):
    """Decoupled GRPO with KL in the reward (k1, fixed β) and a k2 KL loss, token by token."""
    trained = trained_positions(gb)
    behavior = padded(gb.behavior_logprobs, gb.response_offsets).astype(np.float64)
    prox, ref = lp["prox"], lp["ref"]
    beta = GRPO_CONFIG["kl"]["kl_coef"]
    rewards = [
        SCORES[i] - beta * sum((prox[i, t] - ref[i, t]).item() for t in trained[i])
        for i in range(gb.size)
    ]
    advantages = []
    for i in range(gb.size):
        group = [rewards[j] for j in range(gb.size) if gb.group_index[j] == gb.group_index[i]]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        advantages.append((rewards[i] - mean) / (std + 1e-6))
    pg: dict[int, list[torch.Tensor]] = {}
    kl: dict[int, list[torch.Tensor]] = {}
    for i, positions in enumerate(trained):
        pg[i], kl[i] = [], []
        for t in positions:
            weight = math.exp(prox[i, t].item() - behavior[i, t])
            weight = 0.0 if weight > CAP else weight
            pg[i].append(ppo_term(logprob[i, t], prox[i, t], advantages[i], weight, behavior[i, t]))
            kl[i].append(0.5 * (logprob[i, t] - ref[i, t]) ** 2)
    return aggregate(pg, mode) + KL_LOSS_COEF * aggregate(kl, mode)


def learner_grpo(gb: GlobalBatch, lp: dict[str, torch.Tensor], logprob, mode: str):
    cfg = msgspec.convert(GRPO_CONFIG, LearnerConfig)
    targets, metrics = prepare_targets(
        gb, cfg, prox_logprob=lp["prox"], ref_logprob=lp["ref"], values=None,
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
    )  # fmt: skip
    tokens, seqs = global_counts(gb, np.arange(gb.size))
    counts = {"global_token_count": tokens, "global_seq_count": seqs}
    loss, pg_metrics = alg.policy_loss(
        logprob, targets.old_logprob, targets.advantages, targets.mask,
        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
        is_weights=targets.is_weights, behavior_logprob=targets.behavior_logprob,
        loss_agg_mode=mode, **counts,
    )  # fmt: skip
    kl = alg.kl_loss(logprob, lp["ref"], targets.mask, "k2", mode, **counts)
    return loss + KL_LOSS_COEF * kl, {**metrics, **{k: float(v) for k, v in pg_metrics.items()}}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_decoupled_grpo_loss_and_gradient_equal_the_trained_token_reference(mode):
    gb = masked_batch()
    lp = random_logprobs(gb, seed=11)
    logprob = lp["logprob"].clone().requires_grad_(True)
    loss, metrics = learner_grpo(gb, lp, logprob, mode)
    (grad,) = torch.autograd.grad(loss, logprob)

    ref_logprob = lp["logprob"].clone().requires_grad_(True)
    expected = reference_grpo(gb, lp, ref_logprob, mode)
    (expected_grad,) = torch.autograd.grad(expected, ref_logprob)
    # advantages are float32 in the learner (as on the GPU): compare at that precision
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    # the comparison covers every branch: some tokens clipped, some past the behaviour bound
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_behavior"] > 0
    assert grad.abs().sum() > 0

    # hostile values on masked tokens change nothing, not even a bit
    changed, hostile_lp = hostile(gb, lp, {"prox": -80.0, "logprob": -80.0, "ref": 50.0})
    hostile_logprob = hostile_lp["logprob"].clone().requires_grad_(True)
    hostile_loss, hostile_metrics = learner_grpo(changed, hostile_lp, hostile_logprob, mode)
    (hostile_grad,) = torch.autograd.grad(hostile_loss, hostile_logprob)
    assert hostile_loss.item() == loss.item()
    assert torch.equal(hostile_grad, grad)
    assert hostile_metrics == metrics


def reference_ppo(gb: GlobalBatch, lp: dict[str, torch.Tensor], logprob, new_values):
    """Bypass PPO + clipped value loss; GAE over each row's trained steps only (token-mean)."""
    gamma, lam = GAE_CONFIG["algorithm"]["gamma"], GAE_CONFIG["algorithm"]["lam"]
    trained = trained_positions(gb)
    behavior = padded(gb.behavior_logprobs, gb.response_offsets).astype(np.float64)
    values = lp["values"]
    raw: dict[tuple[int, int], float] = {}
    for i, positions in enumerate(trained):
        next_value = next_advantage = 0.0
        for t in reversed(positions):
            reward = SCORES[i] if t == positions[-1] else 0.0
            delta = reward + gamma * next_value - values[i, t].item()
            next_advantage = delta + gamma * lam * next_advantage
            next_value = values[i, t].item()
            raw[(i, t)] = next_advantage
    mean, var = statistics.fmean(raw.values()), statistics.variance(raw.values())
    pg: dict[int, list[torch.Tensor]] = {i: [] for i in range(gb.size)}
    vf: dict[int, list[torch.Tensor]] = {i: [] for i in range(gb.size)}
    for (i, t), advantage in raw.items():
        returns = advantage + values[i, t].item()
        whitened = (advantage - mean) / math.sqrt(var + 1e-8)
        pg[i].append(ppo_term(logprob[i, t], behavior[i, t], whitened))
        old = values[i, t].item()
        clipped = torch.clamp(new_values[i, t], old - CLIP_VALUE, old + CLIP_VALUE)
        vf[i].append(
            0.5 * torch.maximum((new_values[i, t] - returns) ** 2, (clipped - returns) ** 2)
        )
    return aggregate(pg, "token-mean"), aggregate(vf, "token-mean")


def learner_ppo(gb: GlobalBatch, lp: dict[str, torch.Tensor], logprob, new_values):
    cfg = msgspec.convert(GAE_CONFIG, LearnerConfig)
    targets, _ = prepare_targets(
        gb, cfg, prox_logprob=None, ref_logprob=None, values=lp["values"],
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
    )  # fmt: skip
    tokens, seqs = global_counts(gb, np.arange(gb.size))
    pg, _ = alg.policy_loss(
        logprob, targets.old_logprob, targets.advantages, targets.mask,
        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
        is_weights=targets.is_weights, global_token_count=tokens, global_seq_count=seqs,
    )  # fmt: skip
    vf, _ = alg.value_loss(
        new_values, targets.old_values, targets.returns, targets.mask, CLIP_VALUE,
        "token-mean", tokens, seqs,
    )  # fmt: skip
    return pg, vf


def test_ppo_with_a_critic_equals_the_trained_token_reference_and_ignores_masked_tokens():
    gb = masked_batch()
    lp = random_logprobs(gb, seed=5)

    def run(batch, tensors, learner: bool):
        logprob = tensors["logprob"].clone().requires_grad_(True)
        new_values = tensors["new_values"].clone().requires_grad_(True)
        compute = learner_ppo if learner else reference_ppo
        pg, vf = compute(batch, tensors, logprob, new_values)
        return pg, vf, torch.autograd.grad(pg + vf, (logprob, new_values))

    pg, vf, grads = run(gb, lp, learner=True)
    ref_pg, ref_vf, ref_grads = run(gb, lp, learner=False)
    # GAE runs in float32 in the learner (as on the GPU): compare at that precision
    torch.testing.assert_close(pg, ref_pg, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vf, ref_vf, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        assert mine.abs().sum() > 0

    # the critic's values on tool tokens are passed over (verl's masked GAE), as are
    # their behaviour and policy logprobs
    fills = {"logprob": -80.0, "values": 1e3, "new_values": -1e3}
    changed, hostile_lp = hostile(gb, lp, fills)
    hostile_pg, hostile_vf, hostile_grads = run(changed, hostile_lp, learner=True)
    assert (hostile_pg.item(), hostile_vf.item()) == (pg.item(), vf.item())
    for mine, theirs in zip(hostile_grads, grads, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("garbage", [-math.inf, math.nan])
def test_non_finite_logprobs_on_masked_tokens_give_finite_losses_and_zero_gradient_there(
    kind, garbage
):
    gb = masked_batch()
    fills = {"logprob": garbage, "prox": garbage, "ref": -garbage}
    changed, lp = hostile(gb, random_logprobs(gb, seed=2), fills)
    cfg = msgspec.convert(GRPO_CONFIG, LearnerConfig)
    targets, metrics = prepare_targets(
        changed, cfg, prox_logprob=lp["prox"], ref_logprob=lp["ref"], values=None,
        kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
    )  # fmt: skip
    logprob = lp["logprob"].clone().requires_grad_(True)
    loss, _ = alg.policy_loss(
        logprob, targets.old_logprob, targets.advantages, targets.mask,
        is_weights=targets.is_weights, behavior_logprob=targets.behavior_logprob,
    )  # fmt: skip
    loss = loss + alg.kl_loss(logprob, lp["ref"], targets.mask, kind)
    for mode in alg.LOSS_AGG_MODES:  # the aggregation itself must not let a masked -inf in
        loss = loss + alg.agg_loss(logprob, targets.mask, mode)
    (grad,) = torch.autograd.grad(loss, logprob)
    assert math.isfinite(loss.item())
    assert torch.isfinite(grad).all()
    assert torch.all(grad[targets.mask == 0] == 0)
    assert np.isfinite(list(metrics.values())).all()


def test_a_sequence_of_tool_tokens_only_adds_nothing_to_any_aggregation():
    gb = masked_batch()
    mask = torch.tensor(padded(gb.loss_mask, gb.response_offsets), dtype=torch.float64)
    assert mask[3].sum() == 0  # row 3: tool tokens only
    per_token = torch.randn(
        mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    without = torch.cat([per_token[:3], per_token[4:]])
    without_mask = torch.cat([mask[:3], mask[4:]])
    for mode in alg.LOSS_AGG_MODES:
        with_row = alg.agg_loss(per_token, mask, mode)
        assert math.isfinite(with_row.item())
        torch.testing.assert_close(with_row, alg.agg_loss(without, without_mask, mode))
