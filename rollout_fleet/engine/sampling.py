"""Batched next-token sampling with per-row parameters, and the logprob the engine reports.

One call samples every row of the running batch at once: temperature, top-k,
top-p and min-p are per-row tensors, so a batch mixes greedy validation rows
with temperature-1 training rows without Python loops over the vocabulary.

Which logprob is returned (documented contract, DESIGN section 3):
    ``log_softmax(logits / T)`` over the **full vocabulary**, taken at the sampled
    token, where ``T`` is the row's temperature. Top-k / top-p / min-p only
    restrict which tokens may be drawn; the reported logprob is *not*
    renormalised over the kept set. This is what SGLang returns by default
    (log of the temperature-scaled probabilities before its top-k/top-p
    renormalisation) and what the learner recomputes (``log_softmax(logits/T)``),
    so importance ratios are unbiased for T != 1. ``temperature == 0`` means
    greedy (argmax of the raw logits) and reports ``log_softmax(logits)`` at T = 1.

Top log-probs (``top_logprobs_num`` of ``/generate``): a row asking for ``k`` gets the
``k`` largest entries of that same distribution, highest first, with their token ids,
as SGLang takes its ``output_top_logprobs`` from the logprobs it reports the sampled
token's from. So the sampled token, whenever it is among the ``k``, carries the same
logprob in both lists, and a greedy row's first entry is the sampled token.

Random draws use the exponential-race form of the Gumbel-max trick
(``argmax(p / q)``, ``q ~ Exp(1)``), which samples exactly from ``p``; ``q`` is
``-log(1 - u)`` of a uniform ``u`` (inverse-CDF sampling: the same distribution as
``Tensor.exponential_``, about five times cheaper on CPU). Rows with a
``sampling_seed`` draw their noise from their own ``torch.Generator`` (one
small draw per seeded row), so a seeded request is reproducible; unseeded rows
share one batched draw.

Left out: repetition / frequency / presence penalties, logit bias, grammar
constraints (the protocol rejects non-neutral values for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# A row whose temperature is at or below this is greedy (SGLang uses the same cut-off idea).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class RowSampling:
    """Sampling parameters of one running sequence, as the sampler needs them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None
    top_logprobs: int = 0  # how many of the largest logprobs to report per token

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def filters(self) -> bool:
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0)


class BatchSampling:
    """Per-row sampling tensors for a batch; rebuilt only when the batch's rows change."""

    def __init__(self, rows: list[RowSampling], device: torch.device | str = "cpu") -> None:
        self.rows = rows
        self.device = torch.device(device)
        greedy = [r.greedy for r in rows]
        self.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=self.device)
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        temps = [1.0 if g else r.temperature for g, r in zip(greedy, rows, strict=True)]
        self.temperatures = torch.tensor(temps, dtype=torch.float32, device=self.device)[:, None]
        self.unit_temperature = all(t == 1.0 for t in temps)
        self.any_filter = any(r.filters for r in rows)
        self.top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=self.device)
        self.top_k = torch.tensor(
            [r.top_k if r.top_k > 0 else 1 << 30 for r in rows],
            dtype=torch.long,
            device=self.device,
        )
        self.min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=self.device)
        self.top_logprobs = max((r.top_logprobs for r in rows), default=0)
        self.seeded_rows = [
            i for i, r in enumerate(rows) if r.generator is not None and not greedy[i]
        ]


def _filtered_logprobs(logprobs: torch.Tensor, params: BatchSampling) -> torch.Tensor:
    """``logprobs`` with tokens outside each row's top-k / top-p / min-p set at -inf."""
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    sorted_p = sorted_lp.exp()
    # Mass strictly before each token: the first token is always kept.
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    remove = mass_before > params.top_p[:, None]
    ranks = torch.arange(logprobs.shape[-1], device=logprobs.device)
    remove |= ranks[None, :] >= params.top_k[:, None]
    remove |= sorted_p < params.min_p[:, None] * sorted_p[:, :1]
    sorted_lp = sorted_lp.masked_fill(remove, float("-inf"))
    return torch.empty_like(logprobs).scatter_(-1, order, sorted_lp)


class Sampled(NamedTuple):
    """One sampled token per row, its logprob, and (when a row asked) the top logprobs.

    ``top_values`` / ``top_ids`` ``[B, K]`` hold, highest first, the ``K`` largest
    logprobs of each row (``K`` the largest ``top_logprobs`` of the batch; a row reads its
    own first ``k``); None when no row asked."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def sample_next_tokens(
    logits: torch.Tensor, params: BatchSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[B, V]``.

    Returns ``(token_ids [B] long, logprobs [B] float32)``; see the module
    docstring for which logprob is reported.
    """
    sampled = sample_tokens(logits, params)
    return sampled.tokens, sampled.logprobs


def sample_tokens(logits: torch.Tensor, params: BatchSampling) -> Sampled:
    """``sample_next_tokens`` with the top logprobs the batch's rows asked for."""
    tokens, logprobs = _sample(logits.float(), params)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    if not params.top_logprobs:
        return Sampled(tokens, chosen)
    k = min(params.top_logprobs, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1)
    return Sampled(tokens, chosen, top.values, top.indices)


def _sample(logits: torch.Tensor, params: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled tokens ``[B]`` and the full logprobs ``[B, V]`` they are reported from."""
    if params.all_greedy:
        return logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1)

    scaled = logits if params.unit_temperature else logits / params.temperatures
    logprobs = torch.log_softmax(scaled, dim=-1)
    draw_from = _filtered_logprobs(logprobs, params) if params.any_filter else logprobs
    uniform = torch.empty_like(draw_from).uniform_()
    for row in params.seeded_rows:
        uniform[row].uniform_(generator=params.rows[row].generator)
    # q = -log(1 - u) ~ Exp(1); argmax(p / q) == argmax(log p - log q); -inf (filtered) never wins.
    log_q = torch.log1p(-uniform).neg_().log_()
    tokens = (draw_from - log_q).argmax(dim=-1)
    if params.any_greedy:
        tokens = torch.where(params.greedy_mask, logits.argmax(dim=-1), tokens)
    return tokens, logprobs
