"""Masked statistics and loss aggregation over ``[batch, response_len]`` tensors.

Every learner loss is a per-token matrix reduced under a ``response_mask`` (1 for
trained response tokens, 0 for padding and for a tool's or environment's reply
inside a multi-turn response). This module holds the reductions:
``masked_mean``, ``masked_var``, ``masked_whiten`` (verl semantics: unbiased
variance) and ``agg_loss``, the four loss aggregation modes of verl.

Split invariance (the reason ``agg_loss`` takes global counts)
----------------------------------------------------------------
A loss normalised by the *local* token count of a micro-batch gives a gradient
that depends on how the global batch was cut into ranks and micro-batches. With
``global_token_count`` (``global_seq_count`` for the seq modes) the local loss is
``sum(loss·mask) / global_count · dp_size``; the caller then

* **sums** (never averages) the losses/gradients of its micro-batches
  (plain gradient accumulation: call ``backward`` on each, no ``/ n_micro``), and
* passes ``dp_size`` = the number of data-parallel ranks whose gradients FSDP
  **averages** (FSDP2's reduce-scatter divides by the world size; the factor
  ``dp_size`` undoes that division).

Then ``mean_over_ranks(sum_over_micro(grad))`` equals the gradient of the mean
over the whole global batch, exactly, whatever the split. The counts are the
global ones: ``global_token_count = all_reduce_sum(response_mask.sum())`` over
every micro-batch of every rank in the optimizer step (``global_seq_count``
likewise counts sequences with at least one response token). The same rule
applies to the returned loss value for logging: sum it over micro-batches and
average over ranks to get the global mean.

Left out: sequence-parallel sharding of one sequence across ranks (the counts
would still work, ``seq-mean-token-mean`` would need the per-sequence token
count gathered first).
"""

from __future__ import annotations

from typing import Final

import torch

LOSS_AGG_MODES: Final[tuple[str, ...]] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

WHITEN_EPS: Final[float] = 1e-8


def _check_same_shape(x: torch.Tensor, mask: torch.Tensor, where: str) -> None:
    if x.shape != mask.shape:
        raise ValueError(
            f"{where}: values shape {tuple(x.shape)} != response_mask shape {tuple(mask.shape)}"
        )


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask over ``dim`` (all elements when ``dim`` is None)."""
    _check_same_shape(x, mask, "masked_sum")
    prod = torch.where(mask > 0, x * mask, torch.zeros_like(x))  # a masked inf/NaN stays out
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask / max(Σ mask, 1) over ``dim`` (all elements when ``dim`` is None).

    Masks are 0/1, so the ``max(·, 1)`` only matters for an all-padding slice,
    whose mean is defined as 0 instead of NaN.
    """
    _check_same_shape(x, mask, "masked_mean")
    mask = mask.to(x.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements: mean((x − mean)²)·n/(n−1) when ``unbiased``.

    verl raises for n ≤ 1; here the Bessel factor is skipped for n ≤ 1, which
    gives variance 0 (one element has no spread), so a degenerate batch does not
    kill a training step.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        bessel = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
        variance = variance * bessel
    return variance


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / sqrt(var + 1e-8) with mean and unbiased var over the masked elements.

    ``shift_mean=False`` adds the mean back (scales without centring), as verl.
    Padded positions are transformed too (not zeroed), as verl; callers mask them.
    """
    _check_same_shape(x, mask, "masked_whiten")
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _as_count(count: int | float | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    count_t = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    if count_t.ndim != 0:
        raise ValueError(f"agg_loss: {name} must be a scalar, got shape {tuple(count_t.shape)}")
    if not bool(count_t >= 0):
        raise ValueError(f"agg_loss: {name} must be >= 0, got {count_t.item()}")
    # Zero tokens in the whole step: every local sum is zero too, so the loss is 0.
    return count_t.clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    global_token_count: int | float | torch.Tensor | None = None,
    global_seq_count: int | float | torch.Tensor | None = None,
    *,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar (names and semantics as verl).

    With m the mask, n_i = Σ_t m_it the tokens of sequence i, S the set of
    sequences with n_i > 0, and N = Σ n_i:

    * ``token-mean``: Σ_it L·m / N. With ``global_token_count`` G: Σ L·m / G.
    * ``seq-mean-token-sum``: Σ_{i∈S} (Σ_t L·m) / |S| (``global_seq_count`` replaces |S|).
    * ``seq-mean-token-mean``: Σ_{i∈S} (Σ_t L·m / n_i) / |S| (``global_seq_count`` replaces |S|).
    * ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv 2503.20783): Σ_{i∈S} (Σ_t L·m) / (|S|·C)
      with C = ``loss_scale_factor``, a constant (``global_seq_count`` replaces |S|). The
      learner passes the maximum response length (verl's default for C: its responses are
      padded to ``data.max_response_length``), so the scale is the same for every
      micro-batch, however dynamic batching cuts and pads them; without it C is the padded
      width T of this tensor (verl's fallback), which moves with the padding. verl's
      ``agg_loss`` leaves out the 1/|S| and its actor then scales by the micro-batch's
      share, which makes its value grow with the micro-batch size (equal to this one with
      one sequence per micro-batch); here it is the sequence mean the name says, so the
      step does not grow with the batch.

    Every mode is then multiplied by ``dp_size`` (see the module docstring: pass
    the FSDP data-parallel world size together with global counts; leave 1 for a
    plain local mean). Sequences with no response tokens are excluded from |S|
    (verl's newer behaviour; the old one averaged them in as 0 or NaN); so are
    sequences whose every token is masked (a multi-turn response of tool tokens only).
    """
    _check_same_shape(loss_mat, response_mask, "agg_loss")
    if dp_size < 1:
        raise ValueError(f"agg_loss: dp_size must be >= 1, got {dp_size}")
    mask = response_mask.to(loss_mat.dtype)
    # select, not only multiply: an inf or NaN on a masked position (a tool token's
    # meaningless value) would survive ``x · 0``
    loss_mat = torch.where(mask > 0, loss_mat, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        total = (loss_mat * mask).sum()
        if global_token_count is None:
            loss = total / mask.sum().clamp(min=1)
        else:
            loss = total / _as_count(global_token_count, loss_mat, "global_token_count")
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        token_counts = mask.sum(dim=-1)
        seq_losses = (loss_mat * mask).sum(dim=-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / token_counts.clamp(min=1)
        seq_present = (token_counts > 0).to(loss_mat.dtype)
        total = (seq_losses * seq_present).sum()
        if global_seq_count is None:
            loss = total / seq_present.sum().clamp(min=1)
        else:
            loss = total / _as_count(global_seq_count, loss_mat, "global_seq_count")
    elif mode == "seq-mean-token-sum-norm":
        scale = float(loss_mat.shape[-1]) if loss_scale_factor is None else loss_scale_factor
        if scale <= 0:
            raise ValueError(f"agg_loss: loss_scale_factor must be > 0, got {scale}")
        if global_seq_count is None:
            seqs = (mask.sum(dim=-1) > 0).to(loss_mat.dtype).sum().clamp(min=1)
        else:
            seqs = _as_count(global_seq_count, loss_mat, "global_seq_count")
        loss = (loss_mat * mask).sum() / (seqs * scale)
    else:
        raise ValueError(f"agg_loss: unknown mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    return loss * dp_size if dp_size != 1 else loss
