"""Per-token training targets of one global batch: rewards, advantages, IS weights.

Runs identically on every rank over the *whole* batch (each rank holds it, and
the per-token π_prox / π_ref / V(s) have already been all-reduced into global
tensors), so group statistics, GAE whitening and the KL controller see the
global batch exactly as a single process would, whatever the number of ranks.

Tensors are right-padded ``[B, T]`` over response tokens (``T`` = the longest
response), the layout of ``learner.algorithms``.

Multi-turn responses: ``Targets.mask`` is ``batching.response_mask``, 0 on
padding and on a tool's or environment's reply inside a response (loss mask 0).
Every per-token quantity here is taken under it: such a token has advantage 0,
IS weight 0 and no KL penalty, and its behaviour logprob (0.0 by convention,
meaningless) is never read. The sequence score goes on the last *trained* token
(``alg.scores_to_token_rewards``): verl's placement (the last response token)
whenever the response ends with the policy's own token, and one that keeps the
reward when a response ends on a tool reply (verl's masked GAE would drop a
reward placed on a masked step). GRPO/RLOO broadcast each sequence's advantage
over its trained tokens; GAE and REINFORCE++ pass masked steps through as verl
does (``alg.compute_gae``, ``alg.compute_reinforce_pp_advantages``). A sequence
with no trained token keeps its score in its group's statistics (it is an
outcome of the prompt) but has no token to train.

DAPO's overlong punishment (``algorithm.overlong_buffer_len``) is added to each
score here, before advantages, from the response's length.

Failed rewards (``GlobalBatch.reward_valid`` False): such a sample's loss mask is all
0 (batching.py), so it gets no token reward, no advantage, no IS weight and no KL;
GRPO/RLOO leave it out of its group's mean and std (``valid``), and GAE/REINFORCE++
whiten over the mask, which excludes it. Its score never enters a sum: it is 0.0
here whatever the batch holds. Score metrics are over the valid samples.

Left out: process rewards (one score per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner import algorithms as alg
from learner.batching import GlobalBatch, padded, response_mask
from learner.config import LearnerConfig


@dataclass
class Targets:
    mask: torch.Tensor  # [B, T] float
    old_logprob: torch.Tensor  # π_prox (bypass: π_behav)
    advantages: torch.Tensor
    is_weights: torch.Tensor | None
    ref_logprob: torch.Tensor | None
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    # π_behav for the decoupled loss's behaviour trust region (None: no such bound)
    behavior_logprob: torch.Tensor | None = None
    # π_prox comes from the update's own forward (learner/proximal.py): ``old_logprob`` is
    # then π_behav, a placeholder, and ``is_weights`` None, both made per micro-batch
    proximal_from_update: bool = False
    behavior: torch.Tensor | None = None  # π_behav of every token, for those weights


def ragged_to_padded(flat: torch.Tensor, batch: GlobalBatch) -> torch.Tensor:
    """Flat per-response-token values (batch order) -> ``[B, T]`` (zeros in padding)."""
    lens = batch.response_lens
    width = max(int(lens.max(initial=0)), 1)
    rows = torch.from_numpy(np.repeat(np.arange(batch.size), lens)).to(flat.device)
    cols = torch.from_numpy(
        np.concatenate([np.arange(n) for n in lens]) if len(lens) else np.zeros(0, np.int64)
    ).to(flat.device)
    return flat.new_zeros((batch.size, width)).index_put((rows, cols), flat)


def make_kl_controller(cfg: LearnerConfig) -> alg.FixedKLController | alg.AdaptiveKLController:
    if cfg.kl.kl_ctrl == "adaptive":
        return alg.AdaptiveKLController(cfg.kl.kl_coef, cfg.kl.target_kl, cfg.kl.horizon)
    return alg.FixedKLController(cfg.kl.kl_coef)


def prepare_targets(
    batch: GlobalBatch,
    cfg: LearnerConfig,
    *,
    prox_logprob: torch.Tensor | None,
    ref_logprob: torch.Tensor | None,
    values: torch.Tensor | None,
    kl_ctrl: alg.FixedKLController | alg.AdaptiveKLController,
    device: torch.device,
    max_response_length: int = 0,
    proximal_from_update: bool = False,
) -> tuple[Targets, dict[str, float]]:
    """Targets from the global batch; the three model outputs are ``[B, T]`` or None.

    ``max_response_length`` (rollout.max_new_tokens) is needed only by the overlong
    punishment (``algorithm.overlong_buffer_len`` > 0). ``proximal_from_update``: π_prox
    is not known yet (``learner.proximal``); the IS weights are left to the update.
    """
    if proximal_from_update and cfg.kl.use_kl_in_reward:
        raise ValueError("KL in the reward needs π_prox before the update: it cannot come from it")
    mask = torch.from_numpy(response_mask(batch)).to(device)
    width = mask.shape[1]
    behavior = torch.from_numpy(padded(batch.behavior_logprobs, batch.response_offsets, width)).to(
        device
    )
    old_logprob = behavior if prox_logprob is None else prox_logprob
    valid = torch.from_numpy(batch.reward_valid).to(device)
    metrics: dict[str, float] = {}
    scores = _scores(batch, cfg, valid, device, max_response_length, metrics)
    token_rewards = alg.scores_to_token_rewards(scores, mask)
    if cfg.kl.use_kl_in_reward:
        if ref_logprob is None:
            raise ValueError("use_kl_in_reward needs the reference model's logprobs")
        token_rewards, kl_metrics = alg.apply_kl_penalty_to_rewards(
            token_rewards, old_logprob, ref_logprob, mask, kl_ctrl, cfg.kl.kl_in_reward_kind
        )
        metrics.update(kl_metrics)
    group = torch.from_numpy(batch.group_index).to(device)
    advantages, returns = _advantages(cfg, token_rewards, scores, values, mask, group, valid)
    is_weights = None
    corr = cfg.correction
    if corr.mode != "bypass" and not proximal_from_update:
        is_weights = _importance_weights(cfg, old_logprob, behavior, mask, metrics)

    behavior_clip = corr.mode == "decoupled" and corr.decoupled_behavior_clip
    ret = returns if returns is not None else token_rewards.flip(-1).cumsum(-1).flip(-1)
    metrics.update(target_metrics(token_rewards, scores, advantages, ret, values, mask))
    return (
        Targets(
            mask,
            old_logprob,
            advantages,
            is_weights,
            ref_logprob,
            values,
            returns,
            behavior_logprob=behavior if behavior_clip else None,
            proximal_from_update=proximal_from_update,
            behavior=behavior if proximal_from_update else None,
        ),
        metrics,
    )


def _scores(
    batch: GlobalBatch,
    cfg: LearnerConfig,
    valid: torch.Tensor,
    device: torch.device,
    max_response_length: int,
    metrics: dict[str, float],
) -> torch.Tensor:
    """Sequence scores (0.0 where the reward failed) plus DAPO's overlong punishment."""
    scores = torch.from_numpy(batch.scores).to(device)
    scores = torch.where(valid, scores, torch.zeros_like(scores))
    algo = cfg.algorithm
    if algo.overlong_buffer_len > 0:
        penalty = alg.overlong_penalty(
            torch.from_numpy(batch.response_lens).to(device),
            max_response_length,
            algo.overlong_buffer_len,
            algo.overlong_penalty_factor,
        ).to(scores.dtype)
        scores = scores + penalty
        scored = penalty[valid]
        metrics["reward/overlong_penalty/mean"] = float(scored.mean())
        metrics["reward/overlong_frac"] = float((scored < 0).float().mean())
    return scores


def _advantages(
    cfg: LearnerConfig,
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    group: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages of ``algorithm.adv_estimator``, and GAE's returns (else None)."""
    algo = cfg.algorithm
    returns = None
    if algo.adv_estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator gae needs the critic's values")
        advantages, returns = alg.compute_gae(
            token_rewards, values, mask, algo.gamma, algo.lam, whiten=algo.whiten_advantages
        )
    elif algo.adv_estimator in ("grpo", "drgrpo"):
        sequence_rewards = _sequence_rewards(token_rewards, scores, mask)
        advantages = alg.compute_grpo_advantages(
            sequence_rewards,
            group,
            mask,
            norm_by_std=algo.norm_by_std and algo.adv_estimator == "grpo",
            valid=valid,
        )
    elif algo.adv_estimator == "rloo":
        sequence_rewards = _sequence_rewards(token_rewards, scores, mask)
        advantages = alg.compute_rloo_advantages(sequence_rewards, group, mask, valid=valid)
    elif algo.adv_estimator == "reinforce_pp":
        advantages = alg.compute_reinforce_pp_advantages(token_rewards, mask, algo.gamma)
    else:
        raise ValueError(f"unknown adv_estimator {algo.adv_estimator!r}")
    return advantages, returns


def _importance_weights(
    cfg: LearnerConfig,
    old_logprob: torch.Tensor,
    behavior: torch.Tensor,
    mask: torch.Tensor,
    metrics: dict[str, float],
) -> torch.Tensor:
    """π_prox/π_behav weights of ``correction``; their statistics go into ``metrics`` (is/*)."""
    corr = cfg.correction
    is_weights, is_metrics = alg.compute_importance_weights(
        old_logprob,
        behavior,
        mask,
        corr.mode,
        cap=corr.is_cap,
        low=corr.is_low,
        high=corr.is_high,
        decoupled_cap=corr.decoupled_cap or None,
    )
    for key, value in is_metrics.items():
        metrics["is/" + key.removeprefix("is_")] = float(value)
    return is_weights


def target_metrics(
    token_rewards: torch.Tensor,
    scores: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
) -> dict[str, float]:
    """verl's critic/* statistics (its metric_utils.compute_data_metrics): the sequence
    rewards (score and KL penalty, summed), and advantages, returns and values over the
    trained tokens, each mean/max/min; the value head's explained variance with a critic."""
    out: dict[str, float] = {}
    trained = mask > 0
    rewards = _sequence_rewards(token_rewards, scores, mask)
    out.update(_stats("critic/rewards", rewards))
    if not bool(trained.any()):
        out["critic/advantages/mean"] = 0.0
        return out
    out.update(_stats("critic/advantages", advantages[trained]))
    out.update(_stats("critic/returns", returns[trained]))
    if values is not None:
        out.update(_stats("critic/values", values[trained]))
        residual_var = torch.var(returns[trained] - values[trained], unbiased=False)
        return_var = torch.var(returns[trained], unbiased=False)
        out["critic/vf_explained_var"] = float(1.0 - residual_var / (return_var + 1e-5))
    return out


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    return {
        f"{name}/mean": float(values.float().mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


def _sequence_rewards(
    token_rewards: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per sequence, Σ of its trained tokens' rewards (score − β·ΣKL); its score if it has none."""
    summed = (token_rewards * mask).sum(dim=-1)
    return torch.where(mask.sum(dim=-1) > 0, summed, scores.to(summed.dtype))


def batch_metrics(batch: GlobalBatch, policy_version: int) -> dict[str, float]:
    """Scores, lengths and staleness of the global batch (verl metric names)."""
    response_lens = batch.response_lens
    scored = batch.scores[batch.reward_valid]  # a failed reward has no score to report
    if not len(scored):
        scored = np.full(1, np.nan, dtype=np.float32)
    metrics = {
        "critic/score/mean": float(scored.mean()),
        "critic/score/max": float(scored.max()),
        "critic/score/min": float(scored.min()),
        "reward/failed_in_batch": float((~batch.reward_valid).sum()),
        "response_length/mean": float(response_lens.mean()),
        "response_length/max": float(response_lens.max()),
        "response_length/min": float(response_lens.min()),
        "response_length/clip_ratio": float(batch.truncated.mean()),
        "prompt_length/mean": float(batch.prompt_lens.mean()),
        "prompt_length/max": float(batch.prompt_lens.max()),
        "prompt_length/min": float(batch.prompt_lens.min()),
        "perf/total_num_tokens": float(batch.seq_lens.sum()),
        "perf/response_tokens": float(response_lens.sum()),
        # the share of response tokens trained on: the policy's own (multi-turn: not a tool
        # reply), of samples whose reward was scored
        "response/trained_token_fraction": float(batch.loss_mask.sum())
        / max(int(response_lens.sum()), 1),
    }
    has_tokens = response_lens > 0
    if has_tokens.any():
        starts = batch.response_offsets[:-1][has_tokens]
        min_versions = np.minimum.reduceat(batch.token_versions, starts)
        staleness = policy_version - min_versions
        metrics["staleness/mean"] = float(staleness.mean())
        metrics["staleness/max"] = float(staleness.max())
        values, counts = np.unique(staleness, return_counts=True)
        for value, count in zip(values, counts, strict=True):
            metrics[f"staleness/hist_{int(value)}"] = float(count)
    return metrics
