"""KL to a frozen reference policy: estimators, controllers, KL-in-reward, KL-in-loss.

Two places to put the KL (verl's names and semantics):

* in the reward: ``apply_kl_penalty_to_rewards`` subtracts β·KL_t from the token
  scores before advantages are computed; β comes from a ``FixedKLController`` or
  an ``AdaptiveKLController`` (Ziegler et al. 2019, arXiv 1909.08593);
* in the loss: ``kl_loss`` aggregates a per-token estimator like any other loss;
  the caller multiplies it by ``kl_loss_coef`` and adds it to the policy loss.

Estimators (J. Schulman, "Approximating KL divergence", 2020), with
Δ = logprob − ref_logprob, all per token:

* ``k1`` (alias ``kl``): Δ — unbiased, high variance, can be negative;
* ``abs``: |Δ|;
* ``k2`` (alias ``mse``): ½·Δ²;
* ``k3`` (alias ``low_var_kl``): exp(−Δ) + Δ − 1, non-negative and unbiased for
  KL(π‖π_ref) under samples from π; −Δ is clamped to ±20 before exp and the
  result to ±10 (verl's numerical guards).

Left out: the full-vocabulary KL (needs both distributions' logits) and verl's
straight-through ``k3+`` variant.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from learner.masked_ops import agg_loss, masked_mean

KL_KINDS: Final[dict[str, str]] = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "abs": "abs",
}

LOG_RATIO_CLAMP: Final[float] = 20.0
K3_CLAMP: Final[float] = 10.0
ADAPTIVE_KL_MAX_ERROR: Final[float] = 0.2


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kind: str,
    *,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (formulas: module doc).

    With ``response_mask``, Δ is 0 where the mask is 0 (the estimate there is 0 and
    takes no gradient, whatever the logprobs hold).
    """
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"kl_penalty: logprob shape {tuple(logprob.shape)} != "
            f"ref_logprob shape {tuple(ref_logprob.shape)}"
        )
    canonical = KL_KINDS.get(kind)
    if canonical is None:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; expected one of {sorted(KL_KINDS)}")
    log_ratio = logprob - ref_logprob
    if response_mask is not None:
        log_ratio = torch.where(response_mask > 0, log_ratio, torch.zeros_like(log_ratio))
    if canonical == "k1":
        return log_ratio
    if canonical == "abs":
        return log_ratio.abs()
    if canonical == "k2":
        return 0.5 * log_ratio.square()
    ref_over_policy = torch.clamp(-log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    k3 = torch.exp(ref_over_policy) - ref_over_policy - 1
    return torch.clamp(k3, min=-K3_CLAMP, max=K3_CLAMP)


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg_mode: str = "token-mean",
    global_token_count: int | float | torch.Tensor | None = None,
    global_seq_count: int | float | torch.Tensor | None = None,
    *,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """KL-in-the-loss term: ``agg_loss(kl_penalty(logprob, ref_logprob, kind), mask, agg_mode)``.

    Not multiplied by ``kl_loss_coef``: the caller does that. Gradient flows
    through ``logprob`` only if the caller did not detach it; ``ref_logprob`` is
    a frozen model's output. Masked positions (padding, a multi-turn response's
    tool/env tokens) take Δ = 0, so no value there, however extreme, reaches the
    estimator or its gradient.
    """
    per_token = kl_penalty(logprob, ref_logprob, kind, response_mask=response_mask)
    return agg_loss(
        per_token,
        response_mask,
        agg_mode,
        global_token_count,
        global_seq_count,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )


class FixedKLController:
    """A constant KL coefficient β (``update`` is a no-op)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """β adapted toward a target KL: β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon).

    ``n`` is the number of samples the measured KL was averaged over (verl
    passes the batch size), ``horizon`` the number of samples over which a
    constant error compounds to e^±0.2. β must survive a resume, hence
    ``state_dict``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"AdaptiveKLController: init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply β by 1 + clip(current_kl/target − 1, −0.2, 0.2)·n_steps/horizon."""
        error = float(
            np.clip(current_kl / self.target - 1.0, -ADAPTIVE_KL_MAX_ERROR, ADAPTIVE_KL_MAX_ERROR)
        )
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
    *,
    update_controller: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: r_t = score_t − β·KL_t·m_t, then update the controller.

    ``logprob`` is the policy's logprob of the sampled tokens before the update
    (verl uses ``old_log_probs``: π_prox in decoupled PPO). The KL fed to the
    controller is the mean of per-sequence masked means over the sequences with
    at least one masked-in token (verl averages an empty one in as 0), and the
    controller is stepped with n = batch size (verl). Metrics are python floats
    (this runs once per batch, and the controller needs a host value anyway):
    ``actor/reward_kl_penalty`` (that KL) and ``actor/reward_kl_penalty_coeff``
    (the β that was applied, before the update).
    """
    if token_level_scores.shape != response_mask.shape:
        raise ValueError(
            f"apply_kl_penalty_to_rewards: token_level_scores shape "
            f"{tuple(token_level_scores.shape)} != response_mask shape {tuple(response_mask.shape)}"
        )
    with torch.no_grad():
        mask = response_mask.to(token_level_scores.dtype)
        kld = kl_penalty(logprob.detach(), ref_logprob.detach(), kind, response_mask=mask)
        kld = kld.to(mask.dtype) * mask
        beta = kl_ctrl.value
        token_rewards = token_level_scores - beta * kld
        # sequences with no trained token (empty, or tool tokens only) have no KL to measure
        has_tokens = (mask.sum(dim=-1) > 0).to(mask.dtype)
        current_kl = float(masked_mean(masked_mean(kld, mask, dim=-1), has_tokens).item())
    if update_controller:
        kl_ctrl.update(current_kl=current_kl, n_steps=int(token_level_scores.shape[0]))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_rewards, metrics
