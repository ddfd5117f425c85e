"""Ulysses sequence parallelism: one packed micro-batch split along the sequence over k ranks.

With ``learner.sequence_parallel = k`` the learner group of N ranks forms N/k
sequence-parallel (SP) groups of k consecutive ranks; the ranks of one group
take the same micro-batches (data parallelism is over groups) and each runs the
model on its 1/k slice of the packed row. Everything in a decoder block is
per token except attention, so around attention (DeepSpeed Ulysses, as verl's
``ulysses.py`` does it):

    q, k, v  [b, heads, S/k, d]  --all-to-all-->  [b, heads/k, S, d]   (gather sequence, scatter heads)
    attention over the whole sequence for heads/k heads (block-diagonal causal mask of the packing)
    out      [b, S, heads/k, d]  --all-to-all-->  [b, S/k, heads, d]

Rotary embeddings are applied before the exchange, with each token's own
position. The all-to-all's backward is the reverse all-to-all.

Outputs: each rank computes the logprobs (or values) of the response tokens in
its slice; ``gather_tokens`` all-reduces them into the full per-token vector on
every rank of the group with an identity backward (each rank then computes the
same loss, and each gets the gradient of the tokens it holds). With the loss
scaled by the world size as for pure data parallelism, FSDP's average over all
N ranks then yields the exact gradient: the k partial gradients of a group sum
to its micro-batch's gradient.

Installed as a Hugging Face attention implementation (``AttentionInterface``)
named ``fleetrl_ulysses``; the model's own mask is skipped (the attention
builds its mask from the full row's position ids, set per micro-batch by
``set_micro_batch``). Tested: k = 2 equals k = 1 (logprobs, gradients, a whole
step) on gloo.

Left out: flash-attention varlen kernels (the mask is materialised: O(S²)
booleans per micro-batch), heads not divisible by k (checked at load), the
padded (non-packed) layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ATTN_NAME = "fleetrl_ulysses"


@dataclass
class SPGroup:
    group: dist.ProcessGroup | None
    rank: int  # rank within the SP group
    size: int


def new_groups(world_size: int, rank: int, sp: int) -> SPGroup:
    """Form the SP groups (consecutive ranks); every rank must call this. Returns this rank's."""
    if world_size % sp:
        raise ValueError(f"learner.sequence_parallel={sp} must divide the {world_size} ranks")
    mine = None
    for first in range(0, world_size, sp):
        group = dist.new_group(list(range(first, first + sp)))
        if first <= rank < first + sp:
            mine = group
    return SPGroup(mine, rank % sp, sp)


class _AllToAll(torch.autograd.Function):
    """[b, H, s, d] with H split in ``size`` chunks <-> [b, H/size, size·s, d]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return _all_to_all(x, group, size, to_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.size, not ctx.to_heads), None, None, None


def _all_to_all(x: torch.Tensor, group, size: int, to_heads: bool) -> torch.Tensor:
    b, h, s, d = x.shape
    if to_heads:  # [b, H, s, d] -> [b, H/k, k·s, d]
        send = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = torch.empty_like(send)  # recv[j]: sequence chunk j of my heads
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)
    # [b, H/k, k·s, d] -> [b, H, s, d]
    send = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # recv[j]: head chunk j of my sequence slice
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * h, s // size, d)


class _SumIdentityBackward(torch.autograd.Function):
    """All-reduce sum over the group; backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def gather_tokens(local_full: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Per-token values that are zero outside this rank's tokens -> the full vector on every rank."""
    return _SumIdentityBackward.apply(local_full, sp.group)


# The SP group and the mask of the micro-batch being computed (or recomputed under
# gradient checkpointing, after the forward returned): set before each forward.
_current: dict[str, object] = {}


def set_micro_batch(sp: SPGroup, full_position_ids: torch.Tensor) -> None:
    """Block-diagonal causal mask of the whole packed row ([1, S] positions restarting at 0)."""
    seq = torch.cumsum((full_position_ids[0] == 0).long(), dim=0)
    same = seq[:, None] == seq[None, :]
    causal = torch.ones_like(same).tril_()
    _current.update(sp=sp, mask=(same & causal)[None, None])


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """An HF attention function: exchange, sdpa over the full sequence, exchange back."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sp: SPGroup = _current["sp"]  # type: ignore[assignment]
    q, k, v = (_AllToAll.apply(t, sp.group, sp.size, True) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out, _ = sdpa_attention_forward(
        module, q, k, v, _current["mask"], is_causal=False, **kwargs
    )  # [b, S, H/k, d]
    out = _AllToAll.apply(out.transpose(1, 2), sp.group, sp.size, False)  # [b, H, S/k, d]
    return out.transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> None:
    """Make ``model`` (Qwen2, Llama, ...) use the Ulysses attention in every layer."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    model.config._attn_implementation = ATTN_NAME


def pad_to_multiple(ids: torch.Tensor, positions: torch.Tensor, k: int):
    """Pad a packed row to a multiple of k with a dummy sequence of its own (positions from 0)."""
    pad = (-ids.shape[1]) % k
    if not pad:
        return ids, positions
    tail = torch.arange(pad, dtype=positions.dtype, device=positions.device)[None]
    return (
        torch.cat([ids, ids.new_zeros(1, pad)], dim=1),
        torch.cat([positions, tail], dim=1),
    )
