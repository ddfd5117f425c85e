"""Model inputs for one micro-batch, packed or padded, and the forward passes over them.

Packed (``packing: true``): the micro-batch's sequences (prompt + response) are
concatenated into rows whose ``position_ids`` restart at 0 for every
sequence, with no attention mask. transformers 5.x detects the restarts
(``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal
causal mask for sdpa/eager, or uses varlen kernels for flash attention, so no
token attends across a sequence boundary; ``tests/unit/learner/test_packing.py``
pins packed == padded logprobs for Qwen2 and Llama.

How many rows: with flash attention's varlen kernels one row costs what its
sequences cost, so everything goes into one row and no padding is computed.
sdpa and eager compute the whole row × row score matrix and mask it, so one
row of 2,000 tokens made of 64 short sequences cost 4x the padded forward and
backward (measured on CPU, bench ``packed_vs_padded``). Without varlen kernels
the sequences are therefore bin-packed (first fit, longest first) into rows of
at most ``row_tokens`` tokens (``packed_row_budget``: by default the longest
sequence or ``MIN_ROW_TOKENS``, whichever is more), and the rows are padded to
the longest one with a block of their own (positions restarting at 0) that no
real token attends to and no output reads. With that automatic budget, a
micro-batch that right padding computes cheaper (``padding_is_cheaper``: short
sequences of similar length, whose padding wastes less than packed rows' score
matrices) is laid out padded instead.

Padded (``packing: false``): one right-padded row per sequence with an
``attention_mask``; also what a model gets whose attention ignores
position-id boundaries (OPT, BLOOM: ``packing_allowed``, which runs a tiny
twin of the family, ``fleetrl.models.packing_probe``).

Only the positions that predict a response token reach the LM head
(``logits_to_keep`` as an index tensor), so prompt positions cost no
``[tokens, vocab]`` logits. Logprobs are taken at each sequence's rollout
temperature (logits / T), or every importance ratio would be biased.

Outputs are flat per-token tensors in micro-batch order (sequence by sequence,
response token by token) with ``response_offsets`` marking each sequence.

With Ulysses sequence parallelism (``sp``) each rank runs its 1/k slice of the
packed row and the per-token outputs are summed over the group
(``learner.ulysses``).

Shared prompts (``learner.shared_prompt``, ``build_shared_inputs``): the policy's
forward may instead run each distinct prompt of the micro-batch once and the
responses against its cache, where that computes less (``layout_cost``).

Left out: fused/chunked cross-entropy for very large vocabularies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fleetrl.log import get_logger
from learner import shared_prompt, ulysses
from learner.algorithms import entropy_from_logits, logprobs_from_logits
from learner.batching import GlobalBatch
from learner.shared_prompt import SharedPrompts
from learner.ulysses import SPGroup

log = get_logger(__name__)

# Smallest automatic row budget: rows of about this many tokens cost within 20 % of one
# padded row per sequence for short sequences on CPU sdpa (64 × 31 tokens: 38 ms forward
# and backward in rows of 248 against 31.5 ms padded and 123 ms in one row).
MIN_ROW_TOKENS = 256
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def packing_allowed(config: Any, requested: bool, sp_size: int = 1, *, rank: int = 0) -> bool:
    """``learner.packing`` for this model: on only where the family's attention keeps packed
    sequences apart (``fleetrl.models.packing_probe``); otherwise padded rows, said once, and
    refused under sequence parallelism (which splits one packed row)."""
    if not requested:
        return False
    from fleetrl.models.packing_probe import packs_sequences

    if packs_sequences(config):
        return True
    why = f"{config.model_type}'s attention does not keep packed sequences apart"
    if sp_size > 1:
        raise ValueError(f"learner.sequence_parallel={sp_size} needs packing, and {why}")
    if rank == 0:
        log.warning("learner.packing: %s; micro-batches are padded instead", why)
    return False


def packed_row_budget(
    attn_implementation: str | None, configured: int, seq_lens: np.ndarray, sp_size: int = 1
) -> int | None:
    """Token budget of one packed row, or None for a single row.

    One row when the attention has varlen kernels (flash attention) or under
    Ulysses sequence parallelism (which splits one row over its ranks); else
    ``configured`` when > 0, or max(longest sequence, ``MIN_ROW_TOKENS``). A
    sequence longer than the budget gets a row of its own.
    """
    if sp_size > 1 or (attn_implementation or "") in VARLEN_ATTENTION:
        return None
    if configured > 0:
        return configured
    return max(int(seq_lens.max(initial=0)), MIN_ROW_TOKENS)


def layout_cost(lens: np.ndarray, *, packing: bool, budget: int | None, hidden: int) -> float:
    """A layout's cost in token-equivalents: its tokens, padding included, plus its
    score-matrix entries ÷ (6 × hidden) (a block's projections cost about 24·hidden² FLOPs a
    token, its attention 4·hidden a pair of tokens). Packed into one row (``budget`` None,
    varlen kernels) a sequence's scores are its own only."""
    lens = np.asarray(lens, dtype=np.int64)
    if not packing:
        longest = int(lens.max(initial=0))
        return len(lens) * (longest + longest * longest / (6 * hidden))
    if budget is None:
        return float(lens.sum() + (lens * lens).sum() / (6 * hidden))
    _, _, rows, width = pack_rows(lens, budget)
    return rows * (width + width * width / (6 * hidden))


def padding_is_cheaper(lens: np.ndarray, budget: int, hidden: int) -> bool:
    """Whether right padding computes less than packed rows of ``budget`` tokens would
    (``layout_cost``).

    Without varlen kernels a packed row's attention covers its whole row × row
    score matrix, so short sequences of similar length cost more packed than
    padded (the CPU demo: 128 sequences of 24-27 tokens, packed into rows of 256,
    took 188 ms a step against 136 ms padded). Long-tailed lengths still pack.
    """
    if len(lens) < 2:
        return False
    padded = layout_cost(lens, packing=False, budget=None, hidden=hidden)
    return padded <= layout_cost(lens, packing=True, budget=budget, hidden=hidden)


def pack_rows(lens: np.ndarray, budget: int | None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(row of each sequence, its start column, rows, width): first fit, longest first.

    ``budget`` None puts every sequence in one row in order; width is the
    longest row's fill.
    """
    count = len(lens)
    if budget is None:
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        return np.zeros(count, np.int64), starts, 1, int(lens.sum())
    row_of = np.zeros(count, np.int64)
    start_of = np.zeros(count, np.int64)
    fills: list[int] = []
    for j in sorted(range(count), key=lambda k: (-int(lens[k]), k)):
        length = int(lens[j])
        row = next((r for r, fill in enumerate(fills) if fill + length <= budget), len(fills))
        if row == len(fills):
            fills.append(0)
        row_of[j], start_of[j] = row, fills[row]
        fills[row] += length
    return row_of, start_of, len(fills), max(fills)


@dataclass(frozen=True)
class SequenceLayout:
    """Whole sequences laid out in token rows: packed, or one right-padded row each."""

    ids: np.ndarray  # [rows, width]
    positions: np.ndarray  # [rows, width]
    mask: np.ndarray | None  # [rows, width] attention mask when padded, None when packed
    row_of: np.ndarray  # [n] the row of each sequence
    start_of: np.ndarray  # [n] its first column


def layout_sequences(
    seqs: list[np.ndarray], *, packing: bool, row_tokens: int | None
) -> SequenceLayout:
    """Token rows for ``seqs`` (at least one): packed rows with restarting positions
    (``pack_rows``; unfilled tails restart at 0, blocks of their own that nothing reads, no
    longer than the longest sequence),
    or one right-padded row per sequence with an attention mask."""
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    if packing:
        row_of, start_of, num_rows, width = pack_rows(lens, row_tokens)
        ids = np.zeros((num_rows, width), dtype=np.int64)
        positions = np.zeros((num_rows, width), dtype=np.int64)
        for j, s in enumerate(seqs):
            r, c = row_of[j], start_of[j]
            ids[r, c : c + len(s)] = s
            positions[r, c : c + len(s)] = np.arange(len(s))
        # a tail restarts every ``longest`` tokens: a family with learned positions (GPT-2's
        # wpe, OPT's) has none beyond the longest sequence the run allows
        longest = int(lens.max())
        for r, fill in enumerate(np.bincount(row_of, weights=lens, minlength=num_rows)):
            positions[r, int(fill) :] = np.arange(width - int(fill)) % longest
        return SequenceLayout(ids, positions, None, row_of, start_of)
    width = int(lens.max())
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    positions = np.broadcast_to(np.arange(width), ids.shape)
    return SequenceLayout(ids, positions, mask, np.arange(len(seqs)), np.zeros(len(seqs), np.int64))


def as_long(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 tensor on ``device`` from a writable copy of ``array``."""
    return torch.from_numpy(np.array(array, dtype=np.int64)).to(device)


@dataclass
class MicroBatchInputs:
    """Tensors for one forward pass over the sequences ``indices`` of the global batch."""

    indices: np.ndarray  # global sequence indices, in order
    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor  # [rows, length]
    attention_mask: torch.Tensor | None  # [rows, length] when padded
    rows: torch.Tensor  # [N] row of the position predicting each response token
    cols: torch.Tensor  # [N] its column
    labels: torch.Tensor  # [N] the response token ids
    temperature: torch.Tensor  # [N] rollout temperature of each token's sequence
    response_offsets: np.ndarray  # [n+1] into the N response tokens
    # the distinct prompts once (learner.shared_prompt): then input_ids, position_ids and
    # attention_mask are its first pass's, and (rows, cols) index its [n, 1 + W] logits
    shared: SharedPrompts | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.labels.numel())

    @classmethod
    def empty(cls, device: torch.device) -> MicroBatchInputs:
        """A one-token dummy row that reads nothing: a rank with no sequences in a
        micro-batch still runs the forward and backward (FSDP's collectives line up)."""
        zero = torch.zeros(1, 1, dtype=torch.long, device=device)
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(
            np.zeros(0, np.int64), zero, zero.clone(), None, none, none, none,
            torch.ones(0, device=device), np.zeros(1, np.int64),
        )  # fmt: skip


def build_inputs(
    batch: GlobalBatch,
    indices: np.ndarray,
    *,
    packing: bool,
    device: torch.device,
    row_tokens: int | None = None,
) -> MicroBatchInputs:
    """Packed or padded inputs for ``indices`` (an empty set yields a one-token dummy row).

    ``row_tokens``: packed rows of at most this many tokens (``packed_row_budget``);
    None packs everything into one row.
    """
    response_lens = batch.response_lens[indices]
    response_offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(response_lens, out=response_offsets[1:])
    if len(indices) == 0:
        return MicroBatchInputs.empty(device)
    seqs = [np.concatenate([batch.prompt(i), batch.response(i)]) for i in indices]
    prompt_lens = batch.prompt_lens[indices]
    # Column of the token that predicts response token t of sequence j: start_j + P_j - 1 + t.
    within = np.concatenate(
        [np.arange(p - 1, p - 1 + r) for p, r in zip(prompt_lens, response_lens, strict=True)]
    ).astype(np.int64)
    seq_of_token = np.repeat(np.arange(len(indices)), response_lens)
    layout = layout_sequences(seqs, packing=packing, row_tokens=row_tokens)
    rows = layout.row_of[seq_of_token]
    cols = layout.start_of[seq_of_token] + within
    labels = batch.response_values[
        np.concatenate(
            [np.arange(batch.response_offsets[i], batch.response_offsets[i + 1]) for i in indices]
        )
    ]
    return MicroBatchInputs(
        indices=indices,
        input_ids=as_long(layout.ids, device),
        position_ids=as_long(layout.positions, device),
        attention_mask=None if layout.mask is None else as_long(layout.mask, device),
        rows=as_long(rows, device),
        cols=as_long(cols, device),
        labels=as_long(labels, device),
        temperature=torch.from_numpy(batch.temperature[indices][seq_of_token]).to(device),
        response_offsets=response_offsets,
    )


def build_shared_inputs(
    batch: GlobalBatch,
    indices: np.ndarray,
    device: torch.device,
    prompts: tuple[list[np.ndarray], np.ndarray] | None = None,
) -> MicroBatchInputs:
    """Inputs for ``indices`` with their distinct prompts run once (``learner.shared_prompt``):
    response token t of sequence j is read at (j, t) of the shared forward's ``[n, 1 + W]``
    logits. An empty set yields a one-prompt dummy that reads nothing but runs both passes
    (every rank of an FSDP group calls the model as often). ``prompts``:
    ``shared_prompt.distinct_prompts``' answer for ``indices``, where the caller has it."""
    response_lens = batch.response_lens[indices]
    response_offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(response_lens, out=response_offsets[1:])
    shared = shared_prompt.build_shared(batch, indices, device, prompts)
    seq_of_token = np.repeat(np.arange(len(indices)), response_lens)
    within = np.arange(int(response_lens.sum())) - np.repeat(response_offsets[:-1], response_lens)
    labels = [batch.response(int(i)) for i in indices]
    return MicroBatchInputs(
        indices=indices,
        input_ids=shared.prompt_ids,
        position_ids=torch.arange(shared.prompt_ids.shape[1], device=device).expand_as(
            shared.prompt_ids
        ),
        attention_mask=shared.prompt_mask,
        rows=as_long(seq_of_token, device),
        cols=as_long(within, device),
        labels=as_long(np.concatenate(labels) if labels else np.zeros(0, np.int64), device),
        temperature=torch.from_numpy(batch.temperature[indices][seq_of_token]).to(device),
        response_offsets=response_offsets,
        shared=shared,
    )


@dataclass
class TokenOutputs:
    logprobs: torch.Tensor  # [N]
    entropy: torch.Tensor | None  # [N]
    anchor: (
        torch.Tensor
    )  # 0-valued scalar tied to the whole graph (keeps FSDP's backward hooks firing)


@dataclass
class _Slice:
    """This rank's part of a micro-batch under sequence parallelism (all of it without)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    rows: torch.Tensor  # of this rank's response tokens
    cols: torch.Tensor  # in this rank's columns
    tokens: torch.Tensor | None  # their indices among the N response tokens (None: all)


def _slice(mb: MicroBatchInputs, sp: SPGroup | None) -> _Slice:
    if sp is None or sp.size == 1:
        return _Slice(mb.input_ids, mb.position_ids, mb.attention_mask, mb.rows, mb.cols, None)
    ids, positions = ulysses.pad_to_multiple(mb.input_ids, mb.position_ids, sp.size)
    ulysses.set_micro_batch(sp, positions)
    width = ids.shape[1] // sp.size
    start = sp.rank * width
    mine = (mb.cols >= start) & (mb.cols < start + width)
    return _Slice(
        ids[:, start : start + width], positions[:, start : start + width], None,
        mb.rows[mine], mb.cols[mine] - start, torch.nonzero(mine).flatten(),
    )  # fmt: skip


def _full(values: torch.Tensor, part: _Slice, mb: MicroBatchInputs, sp: SPGroup | None):
    """This rank's per-token values -> all N of the micro-batch (summed over the SP group)."""
    if part.tokens is None:
        return values
    full = values.new_zeros(mb.num_tokens).index_put((part.tokens,), values)
    return ulysses.gather_tokens(full, sp)


def policy_forward(
    model: nn.Module, mb: MicroBatchInputs, *, entropy: str = "none", sp: SPGroup | None = None
) -> TokenOutputs:
    """Per-response-token logprobs at the rollout temperatures, and entropies.

    ``entropy``: "none" (not computed), "metric" (computed without grad, for
    logging) or "grad" (differentiable, for an entropy bonus). With ``sp`` (Ulysses)
    this rank computes its slice of the row and every rank of the group returns all N.
    """
    if mb.shared is not None:
        part = _Slice(mb.input_ids, mb.position_ids, mb.attention_mask, mb.rows, mb.cols, None)
        logits, inverse = shared_prompt.logits(model, mb.shared), part.cols  # [n, 1 + W, vocab]
    else:
        part = _slice(mb, sp)
        keep_cols, inverse = torch.unique(part.cols, sorted=True, return_inverse=True)
        if keep_cols.numel() == 0:
            keep_cols = torch.zeros(1, dtype=torch.long, device=mb.input_ids.device)
        logits = model(
            input_ids=part.input_ids,
            position_ids=part.position_ids,
            attention_mask=part.attention_mask,
            use_cache=False,
            logits_to_keep=keep_cols,
        ).logits  # [rows, K, vocab]
    anchor = logits[..., :1].sum() * 0.0
    temperature = mb.temperature if part.tokens is None else mb.temperature[part.tokens]
    labels = mb.labels if part.tokens is None else mb.labels[part.tokens]
    selected = logits[part.rows, inverse].float() / temperature[:, None]
    logprobs = _full(logprobs_from_logits(selected, labels), part, mb, sp)
    token_entropy = None
    if entropy == "grad":
        token_entropy = _full(entropy_from_logits(selected), part, mb, sp)
    elif entropy == "metric":
        with torch.no_grad():
            token_entropy = _full(entropy_from_logits(selected.detach()), part, mb, sp)
    return TokenOutputs(logprobs=logprobs, entropy=token_entropy, anchor=anchor)


def value_forward(
    critic: nn.Module, mb: MicroBatchInputs, *, sp: SPGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N], anchor): V(state before each response token) from a token-classification head."""
    part = _slice(mb, sp)
    out = critic(
        input_ids=part.input_ids,
        position_ids=part.position_ids,
        attention_mask=part.attention_mask,
        use_cache=False,
    )
    scores = out.logits[..., 0]  # [rows, length]
    return _full(scores[part.rows, part.cols].float(), part, mb, sp), scores.sum() * 0.0


def split_by_sequence(flat: torch.Tensor, mb: MicroBatchInputs) -> torch.Tensor:
    """Flat per-token values -> right-padded ``[n, max_response_len]`` (zeros in padding)."""
    lens = np.diff(mb.response_offsets)
    width = max(int(lens.max(initial=0)), 1)
    out = flat.new_zeros((len(lens), width))
    rows = torch.from_numpy(np.repeat(np.arange(len(lens)), lens)).to(flat.device)
    cols = torch.from_numpy(
        np.concatenate([np.arange(n) for n in lens]) if len(lens) else np.zeros(0, np.int64)
    ).to(flat.device)
    return out.index_put((rows, cols), flat)
