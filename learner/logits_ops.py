"""Token logprobs and entropy from logits, without a full-vocabulary fp32 copy.

The learner turns ``[tokens, vocab]`` logits (vocab ~150k for Qwen) into one
logprob per sampled token. The naive ``log_softmax(logits / T).gather(...)``
materialises two more ``[tokens, vocab]`` tensors in the forward pass and keeps
one alive for backward. ``logprobs_from_logits`` instead works over row chunks
in fp32 and saves only the input logits and one fp32 log-normaliser per row;
its backward rebuilds the softmax chunk by chunk:

    logprob = z_y − logsumexp(z),          z = logits / T
    ∂logprob/∂logits = (onehot(y) − softmax(z)) / T

The temperature must be the one the engine sampled with, or every importance
ratio is biased.

``entropy_from_logits`` is H = logsumexp(z) − Σ softmax(z)·z (stable: no
log of a probability); it is differentiable through autograd and, when no
gradient is needed, evaluated in row chunks to bound memory.

Left out: fused/Triton kernels and vocab-parallel (tensor-parallel) logits.
"""

from __future__ import annotations

from typing import Any, Final

import torch

DEFAULT_CHUNK_ROWS: Final[int] = 1024


def _row_chunks(n_rows: int, chunk_rows: int) -> range:
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
    return range(0, n_rows, chunk_rows)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 logits, fp64 for fp64 (tests, references)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _TokenLogprob(torch.autograd.Function):
    """logprob of ``labels`` under softmax(logits / T), chunked forward and backward."""

    @staticmethod
    def forward(
        ctx: Any,
        logits_2d: torch.Tensor,
        labels_1d: torch.Tensor,
        row_temperature: torch.Tensor,
        chunk_rows: int,
    ) -> torch.Tensor:
        n_rows = logits_2d.shape[0]
        dtype = row_temperature.dtype
        out = torch.empty(n_rows, dtype=dtype, device=logits_2d.device)
        log_norm = torch.empty(n_rows, dtype=dtype, device=logits_2d.device)
        for start in _row_chunks(n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            scaled = logits_2d[start:stop].to(dtype) / row_temperature[start:stop, None]
            chunk_norm = torch.logsumexp(scaled, dim=-1)
            picked = scaled.gather(-1, labels_1d[start:stop].unsqueeze(-1)).squeeze(-1)
            out[start:stop] = picked - chunk_norm
            log_norm[start:stop] = chunk_norm
        ctx.save_for_backward(logits_2d, labels_1d, log_norm, row_temperature)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits_2d, labels_1d, log_norm, row_temperature = ctx.saved_tensors
        chunk_rows = ctx.chunk_rows
        grad_logits = torch.empty_like(logits_2d)
        for start in _row_chunks(logits_2d.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits_2d.shape[0])
            chunk_temperature = row_temperature[start:stop, None]
            scaled = logits_2d[start:stop].to(log_norm.dtype) / chunk_temperature
            probs = torch.exp(scaled - log_norm[start:stop].unsqueeze(-1))
            grad_rows = grad_out[start:stop].to(log_norm.dtype).unsqueeze(-1)
            chunk_grad = -probs * grad_rows
            chunk_grad.scatter_add_(-1, labels_1d[start:stop].unsqueeze(-1), grad_rows)
            grad_logits[start:stop] = (chunk_grad / chunk_temperature).to(logits_2d.dtype)
        return grad_logits, None, None, None


def _row_temperatures(
    temperature: float | torch.Tensor, positions: torch.Size, logits: torch.Tensor, where: str
) -> torch.Tensor:
    """Temperature per flattened position ``[N]`` in the compute dtype (validated > 0)."""
    dtype = _compute_dtype(logits)
    if isinstance(temperature, torch.Tensor):
        if temperature.shape not in (positions, torch.Size([])):
            raise ValueError(
                f"{where}: temperature shape {tuple(temperature.shape)} must be a scalar or "
                f"match the positions {tuple(positions)}"
            )
        rows = temperature.to(device=logits.device, dtype=dtype).expand(positions).reshape(-1)
        if rows.numel() and float(rows.min()) <= 0:
            raise ValueError(f"{where}: every temperature must be > 0, got min {float(rows.min())}")
        return rows
    if temperature <= 0:
        raise ValueError(f"{where}: temperature must be > 0, got {temperature}")
    return torch.full((positions.numel(),), float(temperature), dtype=dtype, device=logits.device)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at ``labels``: ``[..., V], [...] -> [...]``.

    ``temperature`` is a number or a tensor shaped like ``labels`` (one per
    token, e.g. per-sample sampling temperatures in a packed batch): pass the raw
    model logits and the temperatures here rather than dividing first, which
    would make a full-vocabulary copy. Computed and returned in fp32 for
    bf16/fp16/fp32 logits (bf16 logprobs are too coarse for PPO ratios), fp64
    for fp64 logits. Peak extra memory is one fp32 ``[chunk_rows, V]`` block,
    forward and backward; no gradient flows to ``temperature``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logprobs_from_logits: logits shape {tuple(logits.shape)} does not match "
            f"labels shape {tuple(labels.shape)} (expected logits = labels shape + [vocab])"
        )
    row_temperature = _row_temperatures(
        temperature, labels.shape, logits, "logprobs_from_logits"
    ).detach()
    vocab = logits.shape[-1]
    logits_2d = logits.reshape(-1, vocab)
    labels_1d = labels.reshape(-1).long()
    if labels_1d.numel():
        # One host sync for both bounds: an out-of-range label is a device-side assert on GPU.
        low, high = torch.stack([labels_1d.min(), labels_1d.max()]).tolist()
        if low < 0 or high >= vocab:
            raise ValueError(
                f"logprobs_from_logits: labels must lie in [0, {vocab}), got min {low}, max {high}"
            )
    token_logprobs = _TokenLogprob.apply(logits_2d, labels_1d, row_temperature, chunk_rows)
    return token_logprobs.reshape(labels.shape)


def _entropy_rows(logits_2d: torch.Tensor, row_temperature: torch.Tensor) -> torch.Tensor:
    logits_2d = logits_2d.to(row_temperature.dtype) / row_temperature[:, None]
    probs = torch.softmax(logits_2d, dim=-1)
    # A -inf logit (a vocabulary mask) has p = 0 and contributes 0, not 0·(−inf) = NaN.
    finite_logits = logits_2d.masked_fill(torch.isneginf(logits_2d), 0.0)
    return torch.logsumexp(logits_2d, dim=-1) - (probs * finite_logits).sum(dim=-1)


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: ``[..., V] -> [...]``.

    H = logsumexp(z) − Σ_v softmax(z)_v · z_v with z = logits / temperature;
    ``temperature`` is a number or one per position. fp32 (fp64 for fp64 logits).
    """
    positions = logits.shape[:-1]
    row_temperature = _row_temperatures(
        temperature, positions, logits, "entropy_from_logits"
    ).detach()
    logits_2d = logits.reshape(-1, logits.shape[-1])
    if torch.is_grad_enabled() and logits.requires_grad:
        return _entropy_rows(logits_2d, row_temperature).reshape(positions)
    out = torch.empty(logits_2d.shape[0], dtype=row_temperature.dtype, device=logits.device)
    for start in _row_chunks(logits_2d.shape[0], chunk_rows):
        stop = start + chunk_rows
        out[start:stop] = _entropy_rows(logits_2d[start:stop], row_temperature[start:stop])
    return out.reshape(positions)
