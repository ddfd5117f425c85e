"""A fused decode step for Llama-family models (Qwen2, Qwen3, Llama, Mistral without
sliding windows), written against the engine's batch KV cache.

Why: at the batch sizes a rollout engine runs on CPU, a decode step through the
Hugging Face module tree is dominated by per-call overhead (about 30 module calls
and 60 tensor ops per layer, a Cache object, a 4-D mask built every step), not
by arithmetic. This step does the same maths in about 15 tensor ops per layer:

- q/k/v and gate/up projections are single GEMMs over *fused* weights. The
  model's own ``q_proj.weight`` etc. are re-pointed to views of the fused
  tensor, so there is one copy of every weight and anything that writes the
  parameters in place (``ModelRunner.load_weights``, a test's ``mul_``) updates
  the fused GEMM too (``check_fused`` verifies the aliasing after a load);
- rotary cos/sin come from a table indexed by each row's position (the same
  float32 product HF computes, so identical values);
- keys/values are written in place at the cache's shared write column and
  attention for the single query per row is two batched GEMVs and a softmax
  over ``[:, :, :length + 1]`` with one additive padding mask shared by all
  layers (SDPA's CPU flash kernel, built for long queries, is several times
  slower here); GQA groups query heads under their kv head instead of
  repeating K/V;
- RMSNorm is ``torch.rms_norm`` in float32 (bit-identical to
  HF's formula there), HF's explicit float32 upcast otherwise.

Prefill, the fallback for other architectures and verification forwards stay on
the Hugging Face model (``ModelRunner``), so this file only has to match HF's
numbers for one new token per row; ``tests/unit/rollout_fleet/test_fused_decoder.py``
compares it with the HF forward for Qwen2, Llama (GQA) and Qwen3.

Left out: sliding-window layers, dynamic / long RoPE (position-dependent
frequencies), non-SiLU MLPs, tensor parallelism. ``build_fused_decoder`` returns
``None`` with the reason for any model outside that set, and the runner uses the
Hugging Face forward instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fleetrl.log import get_logger

log = get_logger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
# RoPE variants whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# Rotary table rows are allocated in multiples of this.
ROPE_TABLE_GROWTH = 256


@dataclass
class _FusedLayer:
    input_norm: torch.Tensor
    input_norm_eps: float
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_norm_eps: float
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output dimension and
    make each module's parameters views of the result (one copy of the weights)."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if all(has_bias):
        bias = torch.cat([lin.bias.detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


def _norm(module: torch.nn.Module) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = module.eps
    return module.weight, float(eps)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot use the fused decode step, or ``None`` if it can."""
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        return "sliding-window attention (mistral sliding_window)"
    base = getattr(model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module with inv_freq"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} (supported: {sorted(STATIC_ROPE_TYPES)})"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "no linear lm_head"
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        if len({p.bias is None for p in projections}) != 1:
            return "q/k/v projections disagree on bias"
        if (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
            return "gate/up projections disagree on bias"
    return None


class FusedDecoder:
    """One decode step of a Llama-family model over ``BatchKVCache`` buffers."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decoding does not support this model: {reason}")
        config = model.config.get_text_config(decoder=True)
        base = model.model
        first_attn = base.layers[0].self_attn
        self.head_dim = int(first_attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first_attn.scaling)
        self.embed = base.embed_tokens.weight
        self.final_norm = _norm(base.norm)
        self.lm_head_weight = model.lm_head.weight
        self.lm_head_bias = model.lm_head.bias
        self.inv_freq = base.rotary_emb.inv_freq.detach().float()
        self.attention_scaling = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.dtype = self.embed.dtype
        self.layers: list[_FusedLayer] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gu_w, gu_b = _fuse([mlp.gate_proj, mlp.up_proj])
            for lin, fused in (
                (attn.q_proj, qkv_w),
                (attn.k_proj, qkv_w),
                (attn.v_proj, qkv_w),
                (mlp.gate_proj, gu_w),
                (mlp.up_proj, gu_w),
            ):
                self._views.append((lin.weight, fused))
            q_norm = _norm(attn.q_norm) if hasattr(attn, "q_norm") else None
            k_norm = _norm(attn.k_norm) if hasattr(attn, "k_norm") else None
            in_w, in_eps = _norm(layer.input_layernorm)
            post_w, post_eps = _norm(layer.post_attention_layernorm)
            self.layers.append(
                _FusedLayer(
                    input_norm=in_w,
                    input_norm_eps=in_eps,
                    qkv_weight=qkv_w,
                    qkv_bias=qkv_b,
                    q_norm=q_norm,
                    k_norm=k_norm,
                    o_weight=attn.o_proj.weight,
                    o_bias=attn.o_proj.bias,
                    post_norm=post_w,
                    post_norm_eps=post_eps,
                    gate_up_weight=gu_w,
                    gate_up_bias=gu_b,
                    down_weight=mlp.down_proj.weight,
                    down_bias=mlp.down_proj.bias,
                )
            )
        self._cos = torch.zeros(0, self.head_dim, dtype=self.dtype)
        self._sin_signed = torch.zeros(0, self.head_dim, dtype=self.dtype)

    def check_fused(self) -> None:
        """Raise if a parameter no longer aliases its fused tensor (it was replaced, not copied into)."""
        for param, fused in self._views:
            base = fused.untyped_storage().data_ptr()
            if param.untyped_storage().data_ptr() != base:
                raise RuntimeError(
                    "a fused projection weight was replaced instead of copied into;"
                    " the fused decode step would use stale weights"
                )

    # -- rotary ----------------------------------------------------------------------------

    def _ensure_rope(self, positions_needed: int, device: torch.device) -> None:
        if self._cos.shape[0] >= positions_needed and self._cos.device == device:
            return
        size = -(-positions_needed // ROPE_TABLE_GROWTH) * ROPE_TABLE_GROWTH
        # The same float32 product HF's rotary module computes, so cos/sin are identical.
        positions = torch.arange(size, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        half = self.head_dim // 2
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2).
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self._cos, self._sin_signed = cos, sin_signed

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # HF's RMSNorm: normalise in float32, cast back, then scale. In float32 the
        # single fused op gives bit-identical results (checked in the tests).
        if x.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), weight, eps)
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    # -- the step --------------------------------------------------------------------------

    def decode(
        self,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        attend: torch.Tensor,
        write_column: int,
    ) -> torch.Tensor:
        """Logits ``[rows, V]`` for one new token per row.

        ``positions [rows]`` are the tokens' position ids; ``keys``/``values`` the
        per-layer buffers ``[rows, kv_heads, capacity, head_dim]``, written at
        ``write_column``; ``attend [rows, write_column + 1]`` (bool) marks the
        columns each row may attend to, the new one included.
        """
        rows = next_tokens.shape[0]
        nq, nk, hd = self.num_heads, self.num_kv_heads, self.head_dim
        self._ensure_rope(write_column + 1, next_tokens.device)
        cos = self._cos[positions][:, None, :]
        sin_signed = self._sin_signed[positions][:, None, :]
        half = hd // 2
        # Additive mask shared by every layer: 0 where a row may attend, -inf elsewhere.
        mask_bias = torch.where(attend, 0.0, float("-inf")).to(self.dtype)[:, None, None, :]
        end = write_column + 1
        groups = nq // nk
        hidden = torch.embedding(self.embed, next_tokens)
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm, layer.input_norm_eps)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias).view(rows, nq + 2 * nk, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = self._rms_norm(qkv[:, :nq], *layer.q_norm)
                k = self._rms_norm(qkv[:, nq : nq + nk], *layer.k_norm)
                qk = torch.cat((q, k), dim=1)
            else:
                qk = qkv[:, : nq + nk]
            rotated = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin_signed
            k_buf, v_buf = keys[index], values[index]
            k_buf[:, :, write_column] = qk[:, nq:]
            v_buf[:, :, write_column] = qkv[:, nq + nk :]
            # One query per row: two batched GEMVs and a softmax beat SDPA's flash kernel
            # (which is built for long queries) several times over on CPU. Query heads
            # are grouped under their kv head, so GQA needs no repeat of K/V.
            scores = torch.matmul(
                qk[:, :nq].reshape(rows, nk, groups, hd) * self.scaling,
                k_buf[:, :, :end].transpose(-1, -2),
            )
            probs = torch.softmax(scores + mask_bias, dim=-1, dtype=torch.float32)
            attn = torch.matmul(probs.to(self.dtype), v_buf[:, :, :end])
            hidden = hidden + F.linear(attn.reshape(rows, nq * hd), layer.o_weight, layer.o_bias)
            x = self._rms_norm(hidden, layer.post_norm, layer.post_norm_eps)
            gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        hidden = self._rms_norm(hidden, *self.final_norm)
        return F.linear(hidden, self.lm_head_weight, self.lm_head_bias)


def build_fused_decoder(model: torch.nn.Module) -> FusedDecoder | None:
    """A ``FusedDecoder`` for ``model``, or ``None`` (logged with the reason) if unsupported."""
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("fused decode step off (%s); using the Hugging Face forward", reason)
        return None
    return FusedDecoder(model)
