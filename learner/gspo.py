"""GSPO: the clipped policy loss with one importance ratio per sequence.

Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071, the
loss behind Qwen3's RL) replaces PPO's per-token ratio π_θ(y_t)/π_old(y_t),
whose noise grows with the length of the response, by the geometric mean of the
ratios over the sequence's trained tokens (T_i, n_i = |T_i|):

    s_i = exp( (1/n_i) · Σ_{t∈T_i} [log π_θ(y_t) − log π_old(y_t)] )

It is applied per token in the paper's "GSPO-token" form, which keeps the
token's own gradient:

    s_it = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]     (value s_i, ∇s_it = s_i·∇log π_θ(y_t))
    L_it = max(−A_it·s_it, −A_it·clip(s_it, 1 − ε_low, 1 + ε_high))
    L    = mean over sequences of (mean over T_i of L_it)        (seq-mean-token-mean)

so with one advantage per sequence (GRPO, RLOO) the gradient is the paper's
sequence-level one, s_i·A_i·(1/n_i)·Σ_t ∇log π_θ(y_t), and clipping removes a
whole sequence, not single tokens. The paper's clip ranges are tiny (ε_low =
3e-4, ε_high = 4e-4) because s_i is a mean of log-ratios; fleetrl's defaults
(0.2) are PPO's, so a GSPO run sets ``clip_ratio_low``/``clip_ratio_high``.

As verl's ``compute_policy_loss_gspo``:

* the aggregation is always seq-mean-token-mean (``loss_agg_mode`` still
  reduces the entropy bonus and the KL loss; the learner's split-invariant
  ``global_seq_count`` replaces the local count);
* in decoupled mode π_old is π_prox (the learner's recomputed logprobs) and the
  per-token weights w = π_prox/π_behav of ``learner.corrections`` (any mode:
  decoupled, token/sequence TIS or MIS) multiply L_it, as verl multiplies its
  ``rollout_is_weights`` and AReaL its ``behave_imp_weight`` into the GSPO
  loss. A token whose w is 0 keeps its place in n_i and in s_i (fleetrl's rule
  for every correction: a 0 weight removes the token's contribution, not its
  place).

Where fleetrl differs from verl (each is what the PPO path here does too):

* masked positions (padding, a tool's reply) are zeroed before any exp or sum,
  so a NaN or ±inf there never reaches the loss, the gradient or a metric; a
  sequence with no trained token contributes nothing;
* the mean log-ratio is clamped to ±20 (verl: ≤ 10);
* the dual clip (``clip_ratio_c``, arXiv 1912.09729) bounds a sequence with
  A < 0 at −c·A as in the PPO path and AReaL's sequence-level loss; verl's GSPO
  has none (it reports ``pg_clipfrac_lower`` = 0). It binds only when
  s_i > c, a geometric-mean drift of log c per token;
* the behaviour trust region (``decoupled_behavior_clip``) applies at sequence
  level: with ρ_i = exp(mean_{T_i} log(π_θ/π_behav)) (no gradient), a token of
  a sequence already past the GSPO range in its advantage's direction
  (A > 0 and ρ_i > 1 + ε_high, or A < 0 and ρ_i < 1 − ε_low) gets the
  constant max(L_it, −A·clip(ρ_i)): no gradient. verl has no such bound. With
  one mini-batch per step π_prox = π_θ, s_i = 1 and the π_prox clip never
  binds; this bound is then GSPO's only trust region against stale samples.
  With GSPO's ranges it is tight: engine/learner numeric drift alone can pass
  it, which ``pg_clipfrac_behavior`` shows; turn it off for verl's behaviour.

Left out: GSPO's per-sequence advantage averaging (AReaL's form; here a
per-token advantage, e.g. GAE, enters per token as in verl).
"""

from __future__ import annotations

from typing import Final

import torch

from learner.masked_ops import agg_loss, masked_mean

SEQ_LOG_RATIO_CLAMP: Final[float] = 20.0
AGG_MODE: Final[str] = "seq-mean-token-mean"

Count = int | float | torch.Tensor | None


def sequence_log_ratio(
    logprob: torch.Tensor, reference: torch.Tensor, trained: torch.Tensor
) -> torch.Tensor:
    """``[B, 1]``: mean over trained tokens of logprob − reference, clamped to ±20, no gradient.

    Masked positions are selected out before the sum (a ±inf there stays out); a
    row without trained tokens gets 0 (ratio 1).
    """
    with torch.no_grad():
        difference = torch.where(
            trained, logprob.detach() - reference.detach(), torch.zeros_like(logprob)
        )
        counts = trained.sum(dim=-1, keepdim=True).clamp(min=1).to(difference.dtype)
        mean = difference.sum(dim=-1, keepdim=True) / counts
    return mean.clamp(-SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)


def gspo_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
    behavior_logprob: torch.Tensor | None = None,
    global_seq_count: Count = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GSPO loss (formulas and off-policy composition: module docstring).

    Arguments as ``learner.algorithms.policy_loss`` (``old_logprob`` is π_prox in
    decoupled mode, π_behav in bypass); no ``loss_agg_mode``: GSPO is
    seq-mean-token-mean, with ``global_seq_count`` (sequences with a trained
    token in the whole optimizer step) and ``dp_size`` for split invariance.

    Metrics (0-dim detached tensors, local to this micro-batch): ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``pg_clipfrac_behavior`` (fractions of trained tokens
    where the GSPO clip, the dual clip, the behaviour trust region was active:
    whole sequences, counted in tokens), ``ppo_kl`` (token mean of
    old_logprob − logprob, as verl), ``pg_loss``, and per sequence with a trained
    token: ``seq_ratio_mean`` (mean of s_i) and ``seq_ratio_abs_dev`` (mean of
    |s_i − 1|, the drift to compare with the clip range).
    """
    for name, tensor in (
        ("logprob", logprob),
        ("old_logprob", old_logprob),
        ("advantages", advantages),
        ("is_weights", is_weights),
        ("behavior_logprob", behavior_logprob),
    ):
        if tensor is not None and (tensor.shape != response_mask.shape or tensor.ndim != 2):
            raise ValueError(
                f"gspo_policy_loss: {name} shape {tuple(tensor.shape)} must equal the 2-D "
                f"response_mask shape {tuple(response_mask.shape)}"
            )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"gspo_policy_loss: clip ratios must be >= 0, got low={clip_ratio_low}, "
            f"high={clip_ratio_high}"
        )
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"gspo_policy_loss: clip_ratio_c must be > 1, got {clip_ratio_c}")

    trained = response_mask > 0
    seq_log_ratio = sequence_log_ratio(logprob, old_logprob, trained)
    # value s_i, gradient s_i·∇log π_θ(y_t); selected, so a masked −inf logprob gives 0, not NaN
    own_gradient = torch.where(trained, logprob - logprob.detach(), torch.zeros_like(logprob))
    ratio = torch.exp(seq_log_ratio + own_gradient)
    low, high = 1 - clip_ratio_low, 1 + clip_ratio_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, low, high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if clip_ratio_c is not None:
        negative_advantage = advantages < 0
        dual_bound = -advantages * clip_ratio_c
        dual_active = (per_token > dual_bound) & negative_advantage
        per_token = torch.where(negative_advantage, torch.minimum(per_token, dual_bound), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    behavior_active = torch.zeros_like(clip_active)
    if behavior_logprob is not None:
        behavior_ratio = torch.exp(sequence_log_ratio(logprob, behavior_logprob, trained))
        bound = -advantages * torch.clamp(behavior_ratio, low, high)
        past = ((advantages > 0) & (behavior_ratio > high)) | (
            (advantages < 0) & (behavior_ratio < low)
        )
        if is_weights is not None:
            past = past & (is_weights.detach() > 0)
        behavior_active = past & (bound > per_token) & trained
        per_token = torch.where(behavior_active, bound.detach(), per_token)

    loss = agg_loss(
        per_token, response_mask, AGG_MODE, global_seq_count=global_seq_count, dp_size=dp_size
    )
    with torch.no_grad():
        mask = response_mask.to(torch.promote_types(per_token.dtype, torch.float32))
        token_log_ratio = torch.where(
            trained, logprob.detach() - old_logprob.detach(), torch.zeros_like(mask)
        )
        present = trained.any(dim=-1, keepdim=True).to(mask.dtype)
        seq_ratio = torch.exp(seq_log_ratio).to(mask.dtype)
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(mask.dtype), mask),
            "pg_clipfrac_lower": masked_mean(dual_active.to(mask.dtype), mask),
            "pg_clipfrac_behavior": masked_mean(behavior_active.to(mask.dtype), mask),
            "ppo_kl": masked_mean(-token_log_ratio, mask),
            "pg_loss": loss.detach(),
            "seq_ratio_mean": masked_mean(seq_ratio, present),
            "seq_ratio_abs_dev": masked_mean((seq_ratio - 1).abs(), present),
        }
    return loss, metrics
