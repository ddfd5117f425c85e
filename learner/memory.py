"""Memory of one learner rank, estimated from the model's shape and the learner config, and measured.

``ModelShape`` reads a Hugging Face ``config.json`` (or the tiny-model settings)
of any family through one normalisation of its names
(``fleetrl.models.config_sizes``: ``n_embd`` / ``hidden_size``, ``n_head`` /
``num_attention_heads``, ``n_inner`` / ``ffn_dim`` / ``intermediate_size``, ...)
and counts parameters on the model built on the meta device (exact for every
family transformers ships: GPT-2's Conv1D and learned positions, OPT's
projections, Phi's LM-head bias), without loading any weight. ``learner_estimate`` splits
one rank's device memory into what FSDP2 keeps sharded (fp32 master weights,
fp32 gradients, AdamW's two fp32 moments, all ÷ ranks, on the host under
offload; with ``optimizer_offload`` alone the moments live on the host and the device
holds the few chunks of them an update streams through, ``learner.optimizer_offload``),
what it gathers (the root group — embeddings, final norm, LM head — for a whole
forward, plus the current and the prefetched block, in the compute dtype), activations of one micro-batch at the per-rank token budget (every
block's input only under gradient checkpointing, plus one block recomputed),
and the LM-head logits of the response tokens (compute dtype, an fp32 copy, its
log-softmax / gradient). The reference (frozen: sharded weights + gathered
blocks) and the critic (like the policy, with a one-column head) live on the
same devices. ``peak_memory_gb`` is what the learner measures, for
``perf/peak_memory_gb`` next to ``plan/learner_gb``.

The activation model is an estimate (per token and block: 8·h + 4·kv + 4·I
values of the compute dtype with flash/sdpa attention, no s² scores); it
counts what autograd keeps, not allocator fragmentation or the CUDA context.

LoRA (``learner.lora.rank`` > 0): the policy's base weights stay (sharded,
fp32, frozen: no gradient, no optimizer state); gradients and AdamW moments are
those of the adapters only (``ModelShape.adapter_params``), and no reference
copy is built (the reference is the policy with its adapters off).

Left out: tensor parallelism, optimizer kinds other than AdamW; a model_type
transformers does not know is counted as a Llama/Qwen2 block layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleetrl.models.config import ModelConfig
from fleetrl.models.config_sizes import ModelSizes, as_config, model_sizes
from learner.config import LearnerConfig

GB = 1024**3


@dataclass(frozen=True)
class LayerCounts:
    """Parameters counted on the model itself, built on the meta device (exact for any family)."""

    blocks: int  # every decoder block together
    largest_block: int  # what one gathered block holds
    embed: int  # the input token embedding
    root_other: int  # the rest outside blocks and head: positions, final norm, projections
    head: int  # the LM head's own parameters (weight and bias); 0 when tied to the embedding
    linears: tuple[tuple[str, int, int], ...]  # (name in its block, in, out) of every block's


def count_layers(config: Any) -> LayerCounts:
    """``LayerCounts`` of a transformers config's causal LM (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fleetrl.models.family import block_linears, decoder_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = decoder_blocks(model)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_params = 0
    if head is not None and head.weight is not embed:
        head_params = sum(p.numel() for p in head.parameters())
    total = sum(p.numel() for p in model.parameters())  # each tied parameter once
    linears = tuple((n, i, o) for b in blocks for n, (i, o) in block_linears(b).items())
    return LayerCounts(
        blocks=sum(sizes),
        largest_block=max(sizes),
        embed=embed.numel(),
        root_other=total - sum(sizes) - embed.numel() - head_params,
        head=head_params,
        linears=linears,
    )


@dataclass(frozen=True)
class ModelShape(ModelSizes):
    """A model's sizes (``fleetrl.models.config_sizes``) and, when transformers knows its
    family, its parameters counted on the model itself (``counts``); without ``counts`` the
    parameters follow the Llama/Qwen2 block layout from the sizes (``qkv_bias``: Qwen2's)."""

    qkv_bias: bool = False
    counts: LayerCounts | None = None

    @classmethod
    def from_config_dict(cls, c: Mapping[str, Any] | Any) -> ModelShape:
        """From a config.json dict (or a transformers config) of any family."""
        config = as_config(c)
        sizes = model_sizes(config)
        counts = None if isinstance(config, Mapping) else count_layers(config)
        qkv_bias = bool(_read_key(config, "attention_bias") or sizes.model_type == "qwen2")
        return cls(**asdict(sizes), qkv_bias=qkv_bias, counts=counts)

    @classmethod
    def from_model_config(cls, model: ModelConfig) -> ModelShape:
        """From ``model.path``'s config.json, else (``create_tiny``) from the tiny-model settings."""
        config_json = Path(model.path) / "config.json"
        if config_json.is_file():
            return cls.from_config_dict(json.loads(config_json.read_text()))
        if not model.create_tiny:
            raise FileNotFoundError(f"{config_json} not found (and model.create_tiny is off)")
        from fleetrl.models.tiny import build_any_tokenizer, tiny_config

        t = model.tiny
        config = tiny_config(
            t.arch, build_any_tokenizer(t.arch), layers=t.layers, hidden=t.hidden,
            heads=t.heads, kv_heads=None, intermediate=None, max_positions=t.max_positions,
            vocab_size=None, tie_embeddings=None,
        )  # fmt: skip
        return cls.from_config_dict(config)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """Parameters of one block (the largest, when they differ)."""
        if self.counts is not None:
            return self.counts.largest_block
        h, q = self.hidden, self.heads * self.head_dim
        attn = h * q + 2 * h * self.kv_dim + q * h
        bias = q + 2 * self.kv_dim if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden if self.counts is None else self.counts.embed

    def root_params(self, *, lm_head: bool = True) -> int:
        """Parameters outside the blocks: embeddings, final norm, the LM head (unless tied),
        or with ``lm_head`` False a critic's one-value head instead."""
        if self.counts is not None:
            head = self.counts.head if lm_head else self.hidden
            return self.counts.embed + self.counts.root_other + head
        head = (
            self.embed_params if lm_head and not self.tied else (self.hidden if not lm_head else 0)
        )
        return self.embed_params + self.hidden + head

    def params(self, *, lm_head: bool = True) -> int:
        blocks = self.counts.blocks if self.counts is not None else self.layers * self.block_params
        return blocks + self.root_params(lm_head=lm_head)

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder block, by module name."""
        if self.counts is not None:
            per_block = len(self.counts.linears) // max(self.layers, 1)
            return {n: (i, o) for n, i, o in self.counts.linears[:per_block]}
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip

    def adapter_params(self, rank: int, target_modules: list[str]) -> int:
        """LoRA parameters (A: rank × in, B: out × rank per targeted layer) over all blocks.

        ``["all-linear"]`` targets every block linear layer (peft leaves the LM head
        out); other names match a layer by its last dotted part(s), as peft's suffix match does.
        """
        every = target_modules == ["all-linear"]

        def targeted(name: str) -> bool:
            return every or any(name == t or name.endswith("." + t) for t in target_modules)

        if self.counts is not None:
            linears = self.counts.linears
        else:
            linears = tuple((n, i, o) for n, (i, o) in self.block_linears().items()) * self.layers
        return sum(rank * (i + o) for name, i, o in linears if targeted(name))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers (an engine's KV cache)."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


def _read_key(config: Mapping[str, Any] | Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


@dataclass
class RoleMemory:
    """One role's bytes on one device, by component (host = bytes kept on the host by offload)."""

    role: str
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    gathered: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    host: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.gathered
            + self.activations
            + self.logits
        )


def tokens_per_rank(cfg: LearnerConfig, max_seq_len: int, mini_batch_seqs: int) -> int:
    """Tokens one rank holds in one micro-batch (its share of the sequences under SP).

    At most the token budget (one sequence always fits) and at most this rank's
    share of a whole mini-batch of full-length sequences.
    """
    sp = cfg.sequence_parallel
    if cfg.use_dynamic_bsz:
        budget = max(cfg.max_tokens_per_micro_batch, -(-max_seq_len // sp))
    else:
        budget = -(-cfg.micro_batch_size * max_seq_len // sp)
    share = -(-mini_batch_seqs * max_seq_len // cfg.num_ranks)
    return max(1, min(budget, share))


def learner_estimate(
    shape: ModelShape,
    cfg: LearnerConfig,
    *,
    on_gpu: bool,
    max_seq_len: int,
    max_response_len: int,
    mini_batch_seqs: int,
    grad_checkpointing: bool,
    with_reference: bool,
    with_critic: bool,
) -> list[RoleMemory]:
    """Per-device memory of one learner rank: policy, then reference and critic if built."""
    from learner.optimizer_offload import STAGED_CHUNKS  # imports torch: the driver need not

    n = cfg.num_ranks
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and on_gpu)
    cb = 2 if bf16 else 4
    offload = cfg.param_offload and on_gpu
    opt_offload = (cfg.optimizer_offload or cfg.param_offload) and on_gpu
    # optimizer_offload alone: the state streams through the device a few chunks at a time
    # (learner.optimizer_offload), the largest parameter's shard whole
    largest_state = 8 * max(shape.embed_params, shape.hidden * shape.intermediate) / n
    staged = STAGED_CHUNKS * max(cfg.optimizer_offload_chunk_mb * 2**20, largest_state)
    tokens = tokens_per_rank(cfg, max_seq_len, mini_batch_seqs)
    response_tokens = tokens * max_response_len / max(max_seq_len, 1)
    per_token_block = cb * (8 * shape.hidden + 4 * shape.kv_dim + 4 * shape.intermediate)
    if grad_checkpointing:
        activations = shape.layers * tokens * shape.hidden * cb + tokens * per_token_block
    else:
        activations = shape.layers * tokens * per_token_block
    gathered_blocks = (1 if n == 1 else 2) * shape.block_params * cb  # current + prefetched

    def trained(role: str, lm_head: bool, logits: float, adapters: int = 0) -> RoleMemory:
        """A trained model; with ``adapters`` (LoRA) only they get gradients and moments."""
        p = shape.params(lm_head=lm_head)
        trainable = adapters or p
        m = RoleMemory(role)
        sharded_w = 4 * (p + adapters) / n
        sharded_g, adam = 4 * trainable / n, 8 * trainable / n
        m.weights = 0.0 if offload else sharded_w
        m.grads = 0.0 if offload else sharded_g
        m.optimizer = 0.0 if offload else min(staged, adam) if opt_offload else adam
        m.host = (sharded_w + sharded_g if offload else 0.0) + (adam if opt_offload else 0.0)
        if n > 1 or bf16:
            m.gathered = shape.root_params(lm_head=lm_head) * cb + gathered_blocks
        m.activations = activations
        m.logits = logits
        return m

    # logits of the response tokens: compute dtype, an fp32 copy, log-softmax / its gradient
    logits = response_tokens * shape.vocab * (cb + 4 + 4)
    lora = cfg.lora
    adapters = shape.adapter_params(lora.rank, lora.target_modules) if lora.rank > 0 else 0
    roles = [trained("policy", True, logits, adapters)]
    if with_reference and not lora.rank:  # LoRA: the reference is the policy, adapters off
        ref = RoleMemory("reference")
        p = shape.params()
        ref_offload = cfg.reference.param_offload and on_gpu
        ref.weights = 0.0 if ref_offload else 4 * p / n
        ref.host = 4 * p / n if ref_offload else 0.0
        ref.gathered = shape.root_params() * cb + gathered_blocks if (n > 1 or bf16) else 0.0
        roles.append(ref)  # its no-grad forward reuses the policy's activation memory
    if with_critic:
        roles.append(trained("critic", False, response_tokens * 4 * 2))
    return roles


def peak_memory_gb(device_type: str, baseline_rss_kb: int = 0) -> float:
    """Measured peak: ``torch.cuda.max_memory_allocated`` on GPU; peak RSS growth on CPU.

    On CPU the process's peak RSS (``VmHWM``) minus ``baseline_rss_kb`` (its RSS
    before the models were built), so that the interpreter and libraries do not count.
    """
    if device_type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / GB
    return max(0, _status_kb("VmHWM") - baseline_rss_kb) * 1024 / GB


def rss_kb() -> int:
    return _status_kb("VmRSS")


def _status_kb(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux; no current RSS
