"""The tensor math of PPO/GRPO with off-policy corrections: advantages and losses.

Pure functions on ``[batch, response_len]`` tensors with a ``response_mask`` (1 for
real response tokens, 0 for padding or tokens excluded from training: a tool's or
environment's reply inside a multi-turn response). Whatever a masked position
holds (a meaningless behaviour logprob, a very negative policy logprob) never
reaches a loss, a gradient or a metric: log-ratios are masked before ``exp``
and ``agg_loss`` selects instead of multiplying. Names and
semantics follow verl's ``verl/trainer/ppo/core_algos.py`` so results can be
checked against it; where this module differs (padding handling, degenerate
groups), the function's docstring says so. Decoupled PPO follows AReaL
(arXiv 2505.24298).

This module is the one import the learner needs: it also re-exports

* ``masked_mean``, ``masked_var``, ``masked_whiten``, ``agg_loss``  (learner.masked_ops)
* ``kl_penalty``, ``kl_loss``, ``FixedKLController``, ``AdaptiveKLController``,
  ``apply_kl_penalty_to_rewards``                                 (learner.kl)
* ``compute_importance_weights``                                  (learner.corrections)
* ``logprobs_from_logits``, ``entropy_from_logits``               (learner.logits_ops)
* ``gspo_policy_loss``, ``GSPO_AGG_MODE``                          (learner.gspo)

A step of the learner, in these terms: scores → ``scores_to_token_rewards``
(optionally ``apply_kl_penalty_to_rewards``) → advantages (``compute_gae`` /
``compute_grpo_advantages`` / ``compute_rloo_advantages`` /
``compute_reinforce_pp_advantages``) → per micro-batch ``logprobs_from_logits``
→ ``compute_importance_weights`` → ``policy_loss`` or ``gspo_policy_loss``
(``learner.policy_loss.loss_mode``) (+ ``value_loss``,
+ ``kl_loss``·coef, − entropy·coef) with global counts for split invariance.

Advantage estimators run under ``no_grad`` and return tensors that are 0 on
padding. Loss metrics are 0-dim detached tensors (no host sync per micro-batch;
call ``.item()`` once per step).

Left out: GMPO/clip-cov/SAPO loss variants, ReMax, pass@k advantages, value
heads and critics themselves (the learner owns the models).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Final, NamedTuple

import numpy as np
import torch

from learner.config import CORRECTION_MODES
from learner.corrections import compute_importance_weights
from learner.gspo import AGG_MODE as GSPO_AGG_MODE
from learner.gspo import gspo_policy_loss
from learner.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    kl_loss,
    kl_penalty,
)
from learner.logits_ops import entropy_from_logits, logprobs_from_logits
from learner.masked_ops import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten

__all__ = [
    "CORRECTION_MODES",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "GSPO_AGG_MODE",
    "agg_loss",
    "apply_kl_penalty_to_rewards",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_importance_weights",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
    "entropy_from_logits",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]

LOG_RATIO_CLAMP: Final[float] = 20.0

GroupIds = Sequence[Hashable] | np.ndarray | torch.Tensor
Count = int | float | torch.Tensor | None


def _check_2d(name: str, tensor: torch.Tensor, mask: torch.Tensor, where: str) -> None:
    if tensor.shape != mask.shape or mask.ndim != 2:
        raise ValueError(
            f"{where}: {name} shape {tuple(tensor.shape)} must equal the 2-D response_mask "
            f"shape {tuple(mask.shape)}"
        )


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(torch.promote_types(like.dtype, torch.float32))


# ---------------------------------------------------------------- rewards


def overlong_penalty(
    response_lens: torch.Tensor, max_response_length: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment per sequence (``[B]``, ≤ 0), as verl's DAPO reward
    manager computes it: with ``expected = max_response_length − buffer_len``, a response of
    length L gets ``min(−(L − expected) / buffer_len × factor, 0)``."""
    if not 0 < buffer_len < max_response_length:
        raise ValueError(
            f"overlong_penalty: buffer_len must be in (0, max_response_length={max_response_length}),"
            f" got {buffer_len}"
        )
    expected = max_response_length - buffer_len
    excess = response_lens.to(torch.float64) - expected
    return torch.clamp(-excess / buffer_len * factor, max=0.0)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome reward as token rewards: ``scores[i]`` on the last token of row i where mask = 1.

    ``[B] -> [B, T]``, zeros elsewhere. The last *trained* token: verl puts the
    score on the last response token, which is the same token whenever the
    response ends with the policy's own token; a multi-turn response that ends on
    a tool's reply (mask 0) still gets its reward, on the policy's last token
    before it, where verl's masked GAE would pass over it and lose it. A row with
    no trained token gets no reward (nothing in it is trained on).
    """
    if scores.ndim != 1 or response_mask.ndim != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores_to_token_rewards: scores shape {tuple(scores.shape)} must be [B] for "
            f"response_mask shape {tuple(response_mask.shape)} = [B, T]"
        )
    valid = response_mask > 0
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device).expand_as(valid)
    last_index = (positions * valid).argmax(dim=-1)
    rewards = torch.zeros(valid.shape, dtype=_float_mask(valid, scores).dtype, device=valid.device)
    rewards[torch.arange(valid.shape[0], device=valid.device), last_index] = scores.to(
        rewards.dtype
    )
    return rewards * valid.any(dim=-1, keepdim=True)


# ---------------------------------------------------------------- advantages


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2015), masked steps passed through.

    Backward over t, with V' the value of the next *valid* step (0 past the end):

        δ_t = r_t + γ·V' − V_t,   A_t = δ_t + γ·λ·A'   (A' the next valid step's A)

    At a masked step (padding, or a tool/observation token inside a multi-turn
    response) neither V' nor A' changes: the step is transparent, as in verl's
    current code. Returns ``(advantages, returns)`` with returns = A + V before
    whitening; advantages are whitened over the mask when ``whiten``; both are 0
    on masked steps.
    """
    _check_2d("token_rewards", token_rewards, response_mask, "compute_gae")
    _check_2d("values", values, response_mask, "compute_gae")
    mask = _float_mask(response_mask, token_rewards)
    rewards = token_rewards.to(mask.dtype)
    values = values.to(mask.dtype)
    next_value = torch.zeros_like(mask[:, 0])
    next_advantage = torch.zeros_like(mask[:, 0])
    advantages = torch.zeros_like(mask)
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        step = mask[:, t]
        next_value = step * values[:, t] + (1 - step) * next_value
        next_advantage = step * advantage_t + (1 - step) * next_advantage
        advantages[:, t] = advantage_t
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns


@torch.no_grad()
def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): discounted reward-to-go, whitened over the batch.

    verl's ``reinforce_plus_plus`` exactly, masked gaps included. Backward over t:

        G_t = r_t + γ·G',   then G' := G_t·mask_t

    so a masked step (a tool/observation token inside a response) ends the
    return: the step before it starts afresh from its own reward, as verl's
    "reset after EOS" does. A = masked_whiten(G)·mask, with mean and unbiased
    variance over the masked-in steps of the whole batch.
    """
    _check_2d("token_rewards", token_rewards, response_mask, "compute_reinforce_pp_advantages")
    mask = _float_mask(response_mask, token_rewards)
    rewards = token_rewards.to(mask.dtype)
    running = torch.zeros_like(mask[:, 0])
    returns = torch.zeros_like(mask)
    for t in reversed(range(mask.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, mask) * mask


def _group_index(group_ids: GroupIds, batch_size: int, device: torch.device) -> torch.Tensor:
    """Dense group index ``[B]`` (0..G−1) from tensor ids or any hashable ids."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.ndim != 1 or group_ids.shape[0] != batch_size:
            raise ValueError(
                f"group_ids tensor shape {tuple(group_ids.shape)} must be [{batch_size}]"
            )
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {batch_size}")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(gid, len(dense)) for gid in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


class GroupStats(NamedTuple):
    """Per sample, the statistics of its group over the group's *valid* samples."""

    rows: torch.Tensor  # samples of the group in the batch, valid or not
    counts: torch.Tensor  # valid samples of the group
    mean: torch.Tensor
    centered: torch.Tensor  # r − mean; 0 for an invalid sample
    std: torch.Tensor  # unbiased


def _group_stats(
    scores: torch.Tensor, group: torch.Tensor, valid: torch.Tensor | None = None
) -> GroupStats:
    """Group statistics over the valid samples (``valid`` None: all), exact zeros for groups
    whose valid scores are all equal (float rounding in the mean would otherwise turn 0
    into ±1e-9/eps). An invalid sample's score (a failed reward) is never read: it is
    replaced by 0 before any sum, so not even a NaN there reaches a statistic."""
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    ones = torch.ones_like(scores)
    rows = zeros.scatter_add(0, group, ones)
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    weight = valid.to(scores.dtype)
    scores = torch.where(valid, scores, torch.zeros_like(scores))
    counts = zeros.scatter_add(0, group, weight)
    mean = zeros.scatter_add(0, group, scores) / counts.clamp(min=1)
    centered = (scores - mean[group]) * weight
    # an invalid sample is left out of the extremes: +inf/-inf never win amax/amin
    group_max = zeros.scatter_reduce(
        0, group, torch.where(valid, scores, torch.full_like(scores, -torch.inf)), "amax",
        include_self=False,
    )  # fmt: skip
    group_min = zeros.scatter_reduce(
        0, group, torch.where(valid, scores, torch.full_like(scores, torch.inf)), "amin",
        include_self=False,
    )  # fmt: skip
    constant = (group_max == group_min)[group]
    centered = torch.where(constant, torch.zeros_like(centered), centered)
    sq_sum = zeros.scatter_add(0, group, centered.square())
    std = torch.sqrt(sq_sum / (counts - 1).clamp(min=1))
    return GroupStats(rows[group], counts[group], mean[group], centered, std[group])


def _check_scores(scores: torch.Tensor, response_mask: torch.Tensor, where: str) -> None:
    if scores.ndim != 1 or response_mask.ndim != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"{where}: scores shape {tuple(scores.shape)} must be [B] for response_mask "
            f"shape {tuple(response_mask.shape)} = [B, T]"
        )


def _valid_tensor(valid: torch.Tensor | None, like: torch.Tensor, where: str) -> torch.Tensor:
    if valid is None:
        return torch.ones(like.shape[0], dtype=torch.bool, device=like.device)
    if valid.shape != like.shape[:1]:
        raise ValueError(f"{where}: valid shape {tuple(valid.shape)} must be [{like.shape[0]}]")
    return valid.to(device=like.device, dtype=torch.bool)


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantage, one scalar per sample broadcast over its tokens.

    A_i = (r_i − mean_g) / (std_g + eps) with the unbiased std of the group g of
    sample i (``torch.std``, as verl), or A_i = r_i − mean_g when
    ``norm_by_std=False`` (Dr. GRPO, arXiv 2503.20783). As verl, a group of
    size 1 uses mean 0 and std 1 (its advantage is its raw score). A group whose
    scores are all equal gets exactly 0. Returns ``[B, T]`` = A_i · mask.

    ``valid`` (``[B]`` bool, None = all): samples whose reward was scored. Mean and
    std are over the valid samples of the group only; an invalid sample gets 0 (its
    score is never read). A group of several samples left with one valid sample has
    no baseline to compare it with: its advantage is 0 (it trains nothing but the KL
    and entropy terms), not the raw score verl gives a group of size 1.
    """
    _check_scores(scores, response_mask, "compute_grpo_advantages")
    mask = _float_mask(response_mask, scores)
    values = scores.to(mask.dtype)
    valid = _valid_tensor(valid, values, "compute_grpo_advantages")
    group = _group_index(group_ids, values.shape[0], values.device)
    stats = _group_stats(values, group, valid)
    singleton = stats.rows == 1
    centered = torch.where(singleton & valid, values, stats.centered)
    if norm_by_std:
        std = torch.where(singleton, torch.ones_like(stats.std), stats.std)
        advantage = centered / (std + eps)
    else:
        advantage = centered
    return advantage.unsqueeze(-1) * mask


@torch.no_grad()
def compute_rloo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): A_i = r_i − mean of the other samples of its group.

    Equivalently n/(n−1)·(r_i − mean_g). As verl, a group of size 1 keeps its raw
    score. Returns ``[B, T]`` = A_i · mask.

    ``valid`` as in ``compute_grpo_advantages``: n and the mean count the group's valid
    samples only, an invalid sample gets 0, and a lone valid sample in a group of
    several (no other sample to leave out) gets 0.
    """
    _check_scores(scores, response_mask, "compute_rloo_advantages")
    mask = _float_mask(response_mask, scores)
    values = scores.to(mask.dtype)
    valid = _valid_tensor(valid, values, "compute_rloo_advantages")
    group = _group_index(group_ids, values.shape[0], values.device)
    stats = _group_stats(values, group, valid)
    counts = stats.counts
    advantage = torch.where(
        counts > 1, stats.centered * counts / (counts - 1).clamp(min=1), torch.zeros_like(values)
    )
    advantage = torch.where((stats.rows == 1) & valid, values, advantage)
    return advantage.unsqueeze(-1) * mask


# ---------------------------------------------------------------- losses


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
    behavior_logprob: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip, dual clip and per-token IS weights.

    With r = exp(clamp(logprob − old_logprob, ±20)) and A the advantage:

        L1 = −A·r,  L2 = −A·clip(r, 1 − ε_low, 1 + ε_high),  L = max(L1, L2)
        for A < 0 only (dual clip, arXiv 1912.09729):  L = min(L, −c·A)
        L ← L · w   (w = ``is_weights``, detached), then ``agg_loss``.

    Decoupled PPO: ``old_logprob`` is π_prox and ``is_weights`` = π_prox/π_behav
    (``compute_importance_weights``). Bypass: ``old_logprob`` = π_behav and
    ``is_weights=None``. ``clip_ratio_c=None`` disables the dual clip.

    ``behavior_logprob`` (decoupled only) adds the trust region around the
    behaviour policy: with ρ = π_θ/π_behav = w·r, a token already past it in its
    advantage's direction (A > 0 and ρ > 1 + ε_high, or A < 0 and ρ < 1 − ε_low)
    gets L = max(L, −A·clip(ρ, 1 − ε_low, 1 + ε_high)), a constant: no gradient.
    Elsewhere L is unchanged, and so is every token with w = 0. With one
    mini-batch per step π_prox = π_θ, r = 1 and the π_prox clip never binds; this
    bound is then the only trust region, and the gradient equals the bypass
    loss's: w·A·∇log π_θ inside it, 0 past it. Without it a stale token that the
    policy has already pushed up (w up to the cap) is pushed again with weight w.

    Metrics (0-dim detached tensors, local to this micro-batch): ``pg_clipfrac``
    (tokens where the clip was active), ``pg_clipfrac_lower`` (tokens where the
    dual clip was active), ``ppo_kl`` (masked mean of old_logprob − logprob),
    ``pg_loss`` (the returned loss, detached).
    """
    _check_policy_loss_args(
        logprob,
        old_logprob,
        advantages,
        response_mask,
        is_weights,
        behavior_logprob,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
    )
    # Masked before exp: a tool/env token's behaviour logprob is 0.0 and its policy logprob
    # can be very negative, and an overflow there would turn its 0 weight into NaN.
    trained = response_mask > 0
    log_ratio = _masked_log_ratio(logprob, old_logprob, trained)
    per_token, clip_active, dual_active = _clipped_surrogate(
        torch.exp(log_ratio), advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    behavior_active = torch.zeros_like(clip_active)
    if behavior_logprob is not None:
        per_token, behavior_active = _behavior_trust_region(
            per_token,
            logprob,
            behavior_logprob,
            advantages,
            trained,
            is_weights,
            clip_ratio_low,
            clip_ratio_high,
        )

    loss = agg_loss(
        per_token,
        response_mask,
        loss_agg_mode,
        global_token_count,
        global_seq_count,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        mask = _float_mask(response_mask, per_token)
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(mask.dtype), mask),
            "pg_clipfrac_lower": masked_mean(dual_active.to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio.detach(), mask),
            "pg_clipfrac_behavior": masked_mean(behavior_active.to(mask.dtype), mask),
            "pg_loss": loss.detach(),
        }
    return loss, metrics


def _check_policy_loss_args(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    behavior_logprob: torch.Tensor | None,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
) -> None:
    """``policy_loss``'s input checks: shapes against the mask, clip ratios in range."""
    for name, tensor in (
        ("logprob", logprob),
        ("old_logprob", old_logprob),
        ("advantages", advantages),
    ):
        _check_2d(name, tensor, response_mask, "policy_loss")
    if is_weights is not None:
        _check_2d("is_weights", is_weights, response_mask, "policy_loss")
    if behavior_logprob is not None:
        _check_2d("behavior_logprob", behavior_logprob, response_mask, "policy_loss")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"policy_loss: clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}"
        )
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"policy_loss: clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token max(−A·r, −A·clip(r)), dual-clipped for A < 0; with where each clip bound."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if clip_ratio_c is not None:
        negative_advantage = advantages < 0
        dual_bound = -advantages * clip_ratio_c
        dual_active = (per_token > dual_bound) & negative_advantage
        per_token = torch.where(negative_advantage, torch.minimum(per_token, dual_bound), per_token)
    else:
        dual_active = torch.zeros_like(clip_active)
    return per_token, clip_active, dual_active


def _behavior_trust_region(
    per_token: torch.Tensor,
    logprob: torch.Tensor,
    behavior_logprob: torch.Tensor,
    advantages: torch.Tensor,
    trained: torch.Tensor,
    is_weights: torch.Tensor | None,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The constant bound on tokens already past the behaviour trust region (see policy_loss)."""
    behavior_ratio = torch.exp(_masked_log_ratio(logprob, behavior_logprob.detach(), trained))
    bound = -advantages * torch.clamp(behavior_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    past = ((advantages > 0) & (behavior_ratio > 1 + clip_ratio_high)) | (
        (advantages < 0) & (behavior_ratio < 1 - clip_ratio_low)
    )
    if is_weights is not None:
        past = past & (is_weights.detach() > 0)
    behavior_active = past & (bound > per_token)
    return torch.where(behavior_active, bound.detach(), per_token), behavior_active


def _masked_log_ratio(
    logprob: torch.Tensor, reference: torch.Tensor, trained: torch.Tensor
) -> torch.Tensor:
    """clamp(logprob − reference, ±20) on trained tokens, 0 elsewhere (no gradient there)."""
    difference = torch.where(trained, logprob - reference, torch.zeros_like(logprob))
    return torch.clamp(difference, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    *,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 style, as verl): ½·agg(max((v − R)², (v_c − R)²)).

    v_c = clip(v, old_v − c, old_v + c). Metrics (0-dim detached tensors):
    ``vf_clipfrac`` (tokens where the clipped term was the larger),
    ``vf_loss`` (the returned loss, detached).
    """
    for name, tensor in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check_2d(name, tensor, response_mask, "value_loss")
    if cliprange_value < 0:
        raise ValueError(f"value_loss: cliprange_value must be >= 0, got {cliprange_value}")
    clipped_values = torch.clamp(
        values, min=old_values - cliprange_value, max=old_values + cliprange_value
    )
    unclipped_sq = (values - returns).square()
    clipped_sq = (clipped_values - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped_sq, clipped_sq),
        response_mask,
        loss_agg_mode,
        global_token_count,
        global_seq_count,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        mask = _float_mask(response_mask, values)
        metrics = {
            "vf_clipfrac": masked_mean((clipped_sq > unclipped_sq).to(mask.dtype), mask),
            "vf_loss": loss.detach(),
        }
    return loss, metrics
