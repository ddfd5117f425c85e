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
and their difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
