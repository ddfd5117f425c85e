"""π_prox from the update's own forward, where that forward is the proximal policy.

The decoupled loss and the importance-sampling corrections anchor PPO's trust
region at π_prox, the policy before this step's update, and weight each token by
π_prox/π_behav (``learner.corrections``). In general π_prox needs a no-grad
forward of its own before the update (``timing_s/old_log_prob``). With one
optimizer step per batch (one epoch, one mini-batch) it does not: every
micro-batch's forward in the update runs the parameters the step started with,
so its logprobs, detached, *are* π_prox, and the ratio r = π_θ/π_prox is exactly
1 in value with the gradient of π_θ. TRL's GRPOTrainer skips its "old" logprobs
the same way when a generated batch makes one optimizer step; verl and AReaL
skip their recompute in the on-policy case.

``from_update`` says when the pass can go. It stays where it changes the result:

- several mini-batches or epochs: π_θ moves between optimizer steps, and π_prox
  must be frozen before the first;
- KL in the reward (``kl.use_kl_in_reward``): the penalty is taken from π_prox
  before advantages are computed;
- dropout active in training mode (a rate in the model's config, or a dropout
  module such as LoRA's): the update's forward is not the deterministic policy
  the no-grad pass measures;
- a step whose policy does not update (critic warm-up);
- ``learner.correction.recompute_proximal=always``.

``FromUpdate`` then gives each micro-batch its π_prox (the detached logprobs) and
IS weights (``compute_importance_weights`` on that micro-batch's rows: every
weight depends on its own row only, so this equals the whole-batch computation
row for row), and gathers the detached logprobs of the whole batch (all-reduced
over ranks, as the recompute is) for the ``is/*`` metrics after the update.
``tests/unit/learner/test_proximal.py`` pins the loss and gradients against the
recompute path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from learner import dist as ldist
from learner.batching import GlobalBatch
from learner.config import LearnerConfig
from learner.corrections import compute_importance_weights
from learner.prepare import ragged_to_padded

# config keys holding a dropout rate (attention_dropout, hidden_dropout_prob, resid_pdrop, ...)
DROPOUT_WORDS = ("dropout", "pdrop")


def has_active_dropout(model: nn.Module) -> bool:
    """Whether training mode would drop anything: a dropout module with p > 0, or a
    config dropout rate > 0 (attention dropout is applied functionally, with no module)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
    config = getattr(model, "config", None)
    values = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    return any(
        isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        for key, value in values.items()
        if any(word in key for word in DROPOUT_WORDS)
    )


def from_update(
    cfg: LearnerConfig, num_mini_batches: int, *, train_policy: bool, policy_dropout: bool
) -> bool:
    """Whether this step takes π_prox from the update's forward (the module docstring's rule;
    ``policy_dropout``: ``has_active_dropout`` of the policy)."""
    correction = cfg.correction
    return (
        correction.mode != "bypass"
        and correction.recompute_proximal == "auto"
        and train_policy
        and cfg.ppo_epochs == 1
        and num_mini_batches == 1
        and not cfg.kl.use_kl_in_reward
        and not policy_dropout
    )


class FromUpdate:
    """Per micro-batch π_prox and IS weights from the update's forward; the batch's
    ``is/*`` metrics once every micro-batch has run."""

    def __init__(self, batch: GlobalBatch, cfg: LearnerConfig, device: torch.device):
        self.batch = batch
        self.correction = cfg.correction
        self.flat = torch.zeros(int(batch.response_lens.sum()), device=device)

    def _weights(self, proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor):
        c = self.correction
        return compute_importance_weights(
            proximal, behavior, mask, c.mode, cap=c.is_cap, low=c.is_low, high=c.is_high,
            decoupled_cap=c.decoupled_cap or None,
        )  # fmt: skip

    def micro_batch(
        self,
        logprob: torch.Tensor,
        flat_logprob: torch.Tensor,
        behavior: torch.Tensor,
        mask: torch.Tensor,
        indices: np.ndarray,
        *,
        record: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(π_prox, IS weights) of one micro-batch, both ``[n, width]`` and detached.

        ``logprob`` is the update forward's ``[n, width]`` (``split_by_sequence``),
        ``flat_logprob`` the same values flat in micro-batch order; ``record``: this
        rank reports them for the batch's metrics (a sequence-parallel group's leader).
        """
        proximal = logprob.detach()
        weights, _ = self._weights(proximal, behavior, mask)
        if record and len(flat_logprob):
            offsets = self.batch.response_offsets
            positions = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in indices])
            index = torch.from_numpy(positions).to(self.flat.device)
            self.flat[index] = flat_logprob.detach().float()
        return proximal, weights

    def metrics(self, behavior: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """The ``is/*`` metrics of the whole batch, as the recompute path reports them."""
        proximal = ragged_to_padded(ldist.all_reduce_sum(self.flat), self.batch)
        _, metrics = self._weights(proximal, behavior, mask)
        return {"is/" + key.removeprefix("is_"): float(value) for key, value in metrics.items()}
