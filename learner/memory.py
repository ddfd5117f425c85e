"""Memory of one learner rank, estimated from the model's shape and the learner config, and measured.

``ModelShape`` reads a Hugging Face ``config.json`` (or the tiny-model settings)
and counts parameters without loading any weight. ``learner_estimate`` splits
one rank's device memory into what FSDP2 keeps sharded (fp32 master weights,
fp32 gradients, AdamW's two fp32 moments, all ÷ ranks, on the host under
offload; with ``optimizer_offload`` alone the moments live on the host and the device
holds the few chunks of them an update streams through, ``learner.optimizer_offload``), what it gathers (the root group — embeddings, final norm, LM head —
for a whole forward, plus the current and the prefetched block, in the compute
dtype), activations of one micro-batch at the per-rank token budget (every
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

Left out: tensor parallelism, optimizer kinds other than AdamW, LoRA targets
other than the seven linear layers of a Qwen2/Llama block (counted as none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fleetrl.models.config import ModelConfig
from learner.config import LearnerConfig
from learner.optimizer_offload import STAGED_CHUNKS

GB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config_dict(cls, c: dict) -> ModelShape:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return cls(
            vocab=int(c["vocab_size"]),
            hidden=hidden,
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            intermediate=int(c["intermediate_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)),
        )

    @classmethod
    def from_model_config(cls, model: ModelConfig) -> ModelShape:
        """From ``model.path``'s config.json, else (``create_tiny``) from the tiny-model settings."""
        config_json = Path(model.path) / "config.json"
        if config_json.is_file():
            return cls.from_config_dict(json.loads(config_json.read_text()))
        if not model.create_tiny:
            raise FileNotFoundError(f"{config_json} not found (and model.create_tiny is off)")
        from fleetrl.models.tiny import DEFAULT_ALPHABET, SPECIAL_TOKENS

        t = model.tiny
        return cls(
            vocab=len(SPECIAL_TOKENS) + len(dict.fromkeys(DEFAULT_ALPHABET)),
            hidden=t.hidden,
            layers=t.layers,
            heads=t.heads,
            kv_heads=t.heads,
            head_dim=t.hidden // t.heads,
            intermediate=4 * t.hidden,
            tied=False,
            qkv_bias=t.arch == "qwen2",
        )

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        h, q = self.hidden, self.heads * self.head_dim
        attn = h * q + 2 * h * self.kv_dim + q * h
        bias = q + 2 * self.kv_dim if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def root_params(self, *, lm_head: bool = True) -> int:
        """Parameters outside the blocks: embeddings, final norm, LM head (unless tied or a critic)."""
        head = (
            self.embed_params if lm_head and not self.tied else (self.hidden if not lm_head else 0)
        )
        return self.embed_params + self.hidden + head

    def params(self, *, lm_head: bool = True) -> int:
        return self.layers * self.block_params + self.root_params(lm_head=lm_head)

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder block, by module name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip

    def adapter_params(self, rank: int, target_modules: list[str]) -> int:
        """LoRA parameters (A: rank × in, B: out × rank per targeted layer) over all blocks.

        ``["all-linear"]`` targets every block linear layer (peft leaves the LM head
        out); other names match a layer by their last dotted part, as peft's suffix match does.
        """
        names = {t.rsplit(".", 1)[-1] for t in target_modules}
        every = target_modules == ["all-linear"]
        per_block = sum(
            rank * (fan_in + fan_out)
            for name, (fan_in, fan_out) in self.block_linears().items()
            if every or name in names
        )
        return self.layers * per_block

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers (an engine's KV cache)."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


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
