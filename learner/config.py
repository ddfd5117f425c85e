"""Learner section of the run config: group, optimizer, algorithm, corrections, batching.

Defaults follow verl (``ppo_trainer.yaml``) unless a field says otherwise. Every
batch-size knob is in sequences or prompt groups and is *global* unless it says
"per rank"; token budgets are per rank.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

AdvEstimator = Literal["grpo", "drgrpo", "gae", "rloo", "reinforce_pp"]
CorrectionMode = Literal[
    "bypass",
    "decoupled",
    "token_tis",
    "token_mis",
    "seq_tis",
    "seq_tis_geo",
    "seq_mis",
    "seq_mis_geo",
]
# every mode, once: the config accepts these and learner.corrections computes them
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
# masked importance sampling: weights outside [is_low, is_high] are masked
MIS_MODES: tuple[str, ...] = tuple(m for m in CORRECTION_MODES if m.endswith(("_mis", "_mis_geo")))
KLKind = Literal["k1", "k2", "k3", "low_var_kl", "kl", "abs", "mse"]
PolicyLossMode = Literal["vanilla", "gspo"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]


class OptimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lr: Annotated[float, Meta(gt=0, description="AdamW learning rate.")] = 1e-6
    weight_decay: Annotated[float, Meta(ge=0, description="AdamW weight decay.")] = 0.01
    betas: Annotated[tuple[float, float], Meta(description="AdamW betas.")] = (0.9, 0.999)
    eps: Annotated[float, Meta(gt=0, description="AdamW epsilon.")] = 1e-8
    warmup_steps: Annotated[int, Meta(ge=0, description="Linear warm-up steps.")] = 0
    warmup_ratio: Annotated[
        float,
        Meta(
            ge=0,
            lt=1,
            description="Warm-up as a fraction of the run's steps (verl's optim.lr_warmup_steps_ratio), used when warmup_steps is 0: int(ratio × total steps) steps.",
        ),
    ] = 0.0
    schedule: Annotated[
        Literal["constant", "cosine"], Meta(description="LR schedule after warm-up.")
    ] = "constant"
    min_lr_ratio: Annotated[
        float, Meta(ge=0, le=1, description="Cosine floor as a fraction of lr.")
    ] = 0.0
    total_steps: Annotated[
        int,
        Meta(
            ge=0,
            description="Steps the cosine schedule spans (0 = the launcher's trainer.total_steps).",
        ),
    ] = 0
    grad_clip: Annotated[float, Meta(gt=0, description="Max global gradient norm.")] = 1.0


class AlgorithmConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    adv_estimator: Annotated[
        AdvEstimator,
        Meta(
            description="Advantage estimator: grpo, drgrpo (GRPO without std division), gae (needs the critic), rloo, reinforce_pp."
        ),
    ] = "grpo"
    norm_by_std: Annotated[
        bool, Meta(description="GRPO: divide group-centred scores by the group std.")
    ] = True
    gamma: Annotated[float, Meta(ge=0, le=1, description="Discount (GAE, REINFORCE++).")] = 1.0
    lam: Annotated[float, Meta(ge=0, le=1, description="GAE lambda.")] = 1.0
    whiten_advantages: Annotated[
        bool, Meta(description="GAE: whiten advantages over the global batch.")
    ] = True
    overlong_buffer_len: Annotated[
        int,
        Meta(
            ge=0,
            description="DAPO's soft overlong punishment (verl's reward_model.overlong_buffer.len): a response longer than rollout.max_new_tokens minus this many tokens loses overlong_penalty_factor × (excess ÷ this) from its score, up to the whole factor at the cap; its length counts every response token (tool replies included, as verl's). Applied by the learner before advantages; the buffer's equal-score filter sees the unpenalised score (DAPO's default filter metric, accuracy). 0 = off.",
        ),
    ] = 0
    overlong_penalty_factor: Annotated[
        float,
        Meta(ge=0, description="The most the overlong punishment takes from a score."),
    ] = 1.0


class PolicyLossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    loss_mode: Annotated[
        PolicyLossMode,
        Meta(
            description="Policy loss (verl's actor.policy_loss.loss_mode). vanilla: PPO clip on per-token ratios. gspo: GSPO (arXiv 2507.18071), one ratio per sequence, the geometric mean of its trained tokens' π_θ/π_old, clipped with clip_ratio_low/high (the paper: 3e-4 / 4e-4; set them, the defaults are PPO's); its policy loss is always seq-mean-token-mean, as in verl, and loss_agg_mode then reduces only the entropy bonus and the KL loss. With a correction, the ratio is against π_prox and the per-token π_prox/π_behav weights multiply the loss as in vanilla; decoupled_behavior_clip bounds π_θ/π_behav per sequence with the GSPO ranges (learner/gspo.py).",
        ),
    ] = "vanilla"
    clip_ratio_low: Annotated[float, Meta(ge=0, description="PPO clip ε_low.")] = 0.2
    clip_ratio_high: Annotated[float, Meta(ge=0, description="PPO clip ε_high.")] = 0.2
    clip_ratio_c: Annotated[
        float, Meta(gt=1, description="Dual-clip bound c for negative advantages.")
    ] = 3.0
    loss_agg_mode: Annotated[
        LossAggMode,
        Meta(
            description="How per-token losses reduce to a scalar (verl names): token-mean over the trained tokens of the mini-batch; seq-mean-token-sum / seq-mean-token-mean over its sequences; seq-mean-token-sum-norm (Dr. GRPO): the sequence mean of token sums over the constant loss_scale_factor. Every mode is exact whatever the split into ranks and micro-batches."
        ),
    ] = "token-mean"
    loss_scale_factor: Annotated[
        int,
        Meta(
            ge=0,
            description="seq-mean-token-sum-norm's constant C (verl's actor.loss_scale_factor); 0 = rollout.max_new_tokens, the maximum response length (verl's default). Fixed, so the scale never moves with how dynamic batching pads a micro-batch.",
        ),
    ] = 0
    entropy_coeff: Annotated[
        float, Meta(ge=0, description="Entropy bonus coefficient (0 = off).")
    ] = 0.0


class CorrectionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Annotated[
        CorrectionMode,
        Meta(
            description="Off-policy correction: bypass (π_prox = behaviour logprobs, no recompute), decoupled PPO (AReaL), token/sequence truncated (tis) or masked (mis) importance sampling. All but bypass need π_prox (see recompute_proximal)."
        ),
    ] = "decoupled"
    is_cap: Annotated[float, Meta(gt=0, description="TIS cap C on π_prox/π_behav.")] = 2.0
    is_low: Annotated[float, Meta(ge=0, description="MIS: weights below this are masked.")] = 0.5
    is_high: Annotated[float, Meta(gt=0, description="MIS: weights above this are masked.")] = 2.0
    decoupled_cap: Annotated[
        float,
        Meta(
            ge=0,
            description="Decoupled: tokens with π_prox/π_behav above this get weight 0 (AReaL's behav_imp_weight_cap, 5.0 in its configs; 0 = no cap). Uncapped, one token weighted 100x can wreck a step at η = 8.",
        ),
    ] = 5.0
    recompute_proximal: Annotated[
        Literal["auto", "always"],
        Meta(
            description="auto: with one epoch and one mini-batch per step (and no dropout, no KL in the reward) π_prox is the policy the update's forward runs, so its logprobs come from that forward, detached, with no pass of their own (TRL, verl and AReaL do the same; learner/proximal.py); always: a separate no-grad forward before every update."
        ),
    ] = "auto"
    decoupled_behavior_clip: Annotated[
        bool,
        Meta(
            description="Decoupled: also clip π_θ/π_behav with the PPO bounds, so a stale token the policy has already moved past the trust region in its advantage's direction gets no gradient. Off by default (AReaL's decoupled loss): on the accuracy bench (η = 4, 6 seeds, lr 1e-4) it cost 12 steps to the target and 0.024 of final held-out score, and off, η = 4 matched sync. With policy_loss.loss_mode=gspo the bound is per sequence (geometric-mean π_θ/π_behav against the GSPO ranges).",
        ),
    ] = False


class KLConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    use_kl_in_reward: Annotated[
        bool, Meta(description="Subtract β·KL(π_behav‖π_ref) from the token rewards.")
    ] = False
    kl_in_reward_kind: Annotated[KLKind, Meta(description="KL estimator used in the reward.")] = (
        "k1"
    )
    kl_coef: Annotated[float, Meta(ge=0, description="Initial β of the in-reward KL.")] = 0.001
    kl_ctrl: Annotated[
        Literal["fixed", "adaptive"], Meta(description="In-reward KL controller.")
    ] = "fixed"
    target_kl: Annotated[float, Meta(gt=0, description="Adaptive controller target KL.")] = 0.1
    horizon: Annotated[int, Meta(gt=0, description="Adaptive controller horizon.")] = 10000
    use_kl_loss: Annotated[
        bool, Meta(description="Add kl_loss_coef·KL(π_θ‖π_ref) to the policy loss.")
    ] = False
    kl_loss_coef: Annotated[float, Meta(ge=0, description="KL loss coefficient.")] = 0.001
    kl_kind: Annotated[
        KLKind, Meta(description="KL estimator of the KL loss (low_var_kl = clipped k3).")
    ] = "low_var_kl"


class CriticConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enabled: Annotated[
        Literal["auto", "on", "off"],
        Meta(description="auto: a critic is built exactly when adv_estimator is gae."),
    ] = "auto"
    model_path: Annotated[
        str,
        Meta(
            description="Hugging Face folder the critic's body starts from (verl's critic.model.path); empty = model.path. It reads the policy's token ids, so its vocabulary must cover the policy's; its value head is new (value_head_init_std)."
        ),
    ] = ""
    warmup_steps: Annotated[
        int,
        Meta(
            ge=0,
            description="The first this many steps train the critic only: the policy, its optimizer and LR schedule stay as they are (verl's trainer.critic_warmup, which counts one more: its critic_warmup N trains the critic alone for N-1 steps).",
        ),
    ] = 0
    optim: Annotated[OptimConfig, Meta(description="Critic optimizer.")] = msgspec.field(
        default_factory=lambda: OptimConfig(lr=1e-5)
    )
    cliprange_value: Annotated[
        float, Meta(gt=0, description="Value clipping range around the old values.")
    ] = 0.5
    loss_agg_mode: Annotated[LossAggMode, Meta(description="Value loss aggregation.")] = (
        "token-mean"
    )
    value_head_init_std: Annotated[
        float,
        Meta(
            ge=0, description="Std of the value head's normal init (0 = zeros: values start at 0)."
        ),
    ] = 0.0
    init_from: Annotated[
        str,
        Meta(
            description="A reward-model folder (as `fleetrl rm train` writes it) the critic starts from: its backbone, and the value head from its score head, so the values start as the reward model's scores (OpenRLHF's default; verl's critic.model.path). It must read the policy's tokens (the same vocabulary). Empty = the policy's backbone with a fresh head (value_head_init_std)."
        ),
    ] = ""


class ReferenceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    param_offload: Annotated[
        bool, Meta(description="Keep the frozen reference's parameters on CPU (GPU runs).")
    ] = False


class LoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    rank: Annotated[
        int,
        Meta(
            ge=0,
            description="LoRA rank on the policy (peft); 0 = off, the whole model trains. With LoRA on, only adapter weights train and sync, and the reference policy is the base model with adapters off (no second copy).",
        ),
    ] = 0
    alpha: Annotated[
        float, Meta(gt=0, description="LoRA alpha (the update is scaled by alpha / rank).")
    ] = 16.0
    target_modules: Annotated[
        list[str],
        Meta(
            description="Module names that get adapters, as peft matches them, in the family's own names (e.g. [q_proj, v_proj] in Llama, [c_attn] in GPT-2; `fleetrl check` names a family's linear layers when one matches nothing); [\"all-linear\"] = every linear layer but the output head (GPT-2's Conv1D included)."
        ),
    ] = msgspec.field(default_factory=lambda: ["all-linear"])
    dropout: Annotated[float, Meta(ge=0, lt=1, description="LoRA dropout.")] = 0.0

    def __post_init__(self) -> None:
        if not self.target_modules or any(not name for name in self.target_modules):
            raise ValueError(
                f"target_modules must name at least one module, got {self.target_modules}"
            )
        if "all-linear" in self.target_modules and self.target_modules != ["all-linear"]:
            raise ValueError(
                f'target_modules: "all-linear" stands alone, got {self.target_modules}'
            )


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    num_ranks: Annotated[
        int,
        Meta(
            ge=1,
            description="FSDP ranks in the learner group (independent of the number of engines).",
        ),
    ] = 1
    cpus_per_rank: Annotated[float, Meta(ge=0, description="Ray CPUs per learner rank.")] = 1.0
    gpus_per_rank: Annotated[float, Meta(ge=0, description="Ray GPUs per learner rank.")] = 0.0
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    policy_loss: PolicyLossConfig = msgspec.field(default_factory=PolicyLossConfig)
    correction: CorrectionConfig = msgspec.field(default_factory=CorrectionConfig)
    kl: KLConfig = msgspec.field(default_factory=KLConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    reference: ReferenceConfig = msgspec.field(default_factory=ReferenceConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    ppo_epochs: Annotated[int, Meta(ge=1, description="Passes over each batch.")] = 1
    ppo_mini_batch_size: Annotated[
        int,
        Meta(
            ge=0,
            description="Prompt groups per optimizer step (0 = the whole batch: one step per batch per epoch).",
        ),
    ] = 0
    use_dynamic_bsz: Annotated[
        bool,
        Meta(description="Cut micro-batches by token budget (max_tokens_per_micro_batch)."),
    ] = True
    max_tokens_per_micro_batch: Annotated[
        int,
        Meta(
            ge=1,
            description="Per-rank token budget of one micro-batch (padded tokens when packing is off). A longer sequence gets a micro-batch of its own.",
        ),
    ] = 16384
    micro_batch_size: Annotated[
        int, Meta(ge=1, description="Sequences per micro-batch when use_dynamic_bsz is off.")
    ] = 4
    packing: Annotated[
        bool,
        Meta(
            description="Pack a micro-batch's sequences into rows with restarting position ids (no padding between them); off = right padding. Without varlen attention kernels and with the automatic packed_row_tokens, a micro-batch that right padding computes cheaper (short sequences of similar length) is padded instead (learner/packing.py padding_is_cheaper)."
        ),
    ] = True
    packed_row_tokens: Annotated[
        int,
        Meta(
            ge=0,
            description="Token budget of one packed row when the attention has no varlen kernels (sdpa, eager: they compute each row's full score matrix). 0 = the micro-batch's longest sequence or 256, whichever is more. With flash attention or sequence parallelism a micro-batch is one row.",
        ),
    ] = 0
    share_prompts: Annotated[
        bool,
        Meta(
            description="Run each distinct prompt of a micro-batch once and its sequences' responses against its keys and values (a GRPO group's n samples share one prompt): the same logprobs and gradients over fewer tokens, taken per micro-batch where it computes less. Off by itself under sequence parallelism, gradient checkpointing, sliding-window attention, or a family whose cache-continued forward differs from its whole forward (tried on a tiny twin); the critic keeps the packed or padded layout.",
        ),
    ] = True
    param_offload: Annotated[
        bool, Meta(description="FSDP2 CPUOffloadPolicy for the policy and critic (GPU runs).")
    ] = False
    optimizer_offload: Annotated[
        bool,
        Meta(
            description="Keep the optimizer state in host memory between steps and stream it through the device chunk by chunk for each update, the copies overlapping the update (learner.optimizer_offload; implied by param_offload on GPU, where FSDP steps on the host)."
        ),
    ] = False
    optimizer_offload_chunk_mb: Annotated[
        int,
        Meta(
            ge=1,
            description="With optimizer_offload: MiB of optimizer state moved and updated at a time; the device holds about three chunks (or three of the largest parameter's state) during the update.",
        ),
    ] = 256
    mixed_precision: Annotated[
        Literal["auto", "fp32", "bf16"],
        Meta(description="auto: bf16 parameters with fp32 gradient reduction on GPU, fp32 on CPU."),
    ] = "auto"
    grad_checkpointing: Annotated[
        bool,
        Meta(
            description="Recompute activations in backward (also on when model.gradient_checkpointing is set)."
        ),
    ] = False
    reshard_after_forward: Annotated[
        bool, Meta(description="FSDP2: free gathered parameters after forward (less memory).")
    ] = True
    sequence_parallel: Annotated[
        int,
        Meta(
            ge=1,
            description="Ulysses sequence parallelism: each packed micro-batch is split along the sequence over this many ranks, with an all-to-all around attention (heads ÷ k per rank). Must divide num_ranks and the model's attention and KV heads; needs packing. A micro-batch then holds up to k × max_tokens_per_micro_batch tokens, each rank about max_tokens_per_micro_batch.",
        ),
    ] = 1
    distributed_timeout_s: Annotated[
        float, Meta(gt=0, description="Timeout of the learner group's collectives.")
    ] = 1800.0
