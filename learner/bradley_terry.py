"""The Bradley-Terry loss of reward-model training, normalised like every learner loss.

For a pair with scores r_c (chosen) and r_r (rejected) and margin m (0 without one):

    loss = -log σ(r_c - r_r - m)

(OpenRLHF's ``PairWiseLoss``; computed as ``softplus(-(r_c - r_r - m))``, which stays
finite for any difference). A step's loss is the mean over its global batch of pairs:
each micro-batch contributes Σ loss / B_global × dp_size (``masked_ops.agg_loss``'s
token-mean with the pairs as tokens), so after FSDP2 averages gradients over the ranks the
gradient is that of the global mean, whatever the split into ranks and micro-batches.

``pair_metrics`` gives the per-pair quantities the metrics average: loss, whether the
chosen response scored higher (pairwise accuracy; a tie counts as wrong), the two scores
and their difference. ``summarize_pairs`` reduces a whole held-out set's scores to
``PairScores`` (accuracy, means, the score's mean and std the exported folder stores).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from fleetrl.models.reward_folder import RewardStats
from learner.masked_ops import agg_loss


def pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair -log σ(r_c - r_r - m), in float32 or wider."""
    dtype = torch.promote_types(chosen.dtype, torch.float32)
    diff = chosen.to(dtype) - rejected.to(dtype)
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return F.softplus(-diff)


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None,
    *,
    global_pair_count: int,
    dp_size: int = 1,
) -> torch.Tensor:
    """This micro-batch's share of the global mean loss, times ``dp_size`` (see above)."""
    losses = pair_losses(chosen, rejected, margin)[:, None]
    return agg_loss(
        losses, torch.ones_like(losses), "token-mean", global_pair_count, dp_size=dp_size
    )


def pair_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Per-pair loss, accuracy (1 when r_c > r_r), chosen and rejected score, r_c - r_r."""
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    return {
        "loss": pair_losses(chosen, rejected, None if margin is None else margin.detach()),
        "acc": (chosen > rejected).float(),
        "chosen_reward": chosen,
        "reject_reward": rejected,
        "margin": chosen - rejected,
    }


class PairScores(msgspec.Struct, frozen=True, kw_only=True):
    """How a reward model scores a set of pairs: what held-out evaluation reports."""

    pairs: int
    accuracy: float  # fraction of pairs with r_c > r_r
    loss: float  # mean -log σ(r_c - r_r - m)
    chosen_mean: float
    rejected_mean: float
    margin_mean: float  # mean r_c - r_r
    score_mean: float  # over the chosen and rejected scores together
    score_std: float

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{key}": float(value) for key, value in msgspec.structs.asdict(self).items()}  # fmt: skip

    def stats(self) -> RewardStats:
        """The statistics a reward-model folder stores (mean/std floor: OpenRLHF's 1e-8)."""
        return RewardStats(
            mean=self.score_mean, std=max(self.score_std, 1e-8), pairs=self.pairs,
            accuracy=self.accuracy,
        )  # fmt: skip


def summarize_pairs(
    chosen: np.ndarray, rejected: np.ndarray, margin: np.ndarray | None = None
) -> PairScores:
    """``PairScores`` of per-pair scores (``margin`` only enters the loss)."""
    chosen, rejected = np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)
    if len(chosen) == 0 or len(chosen) != len(rejected):
        raise ValueError(f"summarize_pairs: {len(chosen)} chosen and {len(rejected)} rejected scores")  # fmt: skip
    losses = pair_losses(
        torch.from_numpy(chosen), torch.from_numpy(rejected),
        None if margin is None else torch.from_numpy(np.asarray(margin, np.float64)),
    )  # fmt: skip
    both = np.concatenate([chosen, rejected])
    return PairScores(
        pairs=len(chosen),
        accuracy=float(np.mean(chosen > rejected)),
        loss=float(losses.mean()),
        chosen_mean=float(chosen.mean()),
        rejected_mean=float(rejected.mean()),
        margin_mean=float(np.mean(chosen - rejected)),
        score_mean=float(both.mean()),
        score_std=float(both.std(ddof=1)) if len(both) > 1 else 0.0,
    )
