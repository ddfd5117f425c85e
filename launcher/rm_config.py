"""The config of a reward-model run (`fleetrl rm train`): typed, validated like the RL run's.

Sections, each a struct with a description per field (``docs/configuration.md``):

    data      PreferenceDataConfig (fleetrl.data.config): preference files, pairs per step,
              token budget per sequence, the demo's synthetic set
    model     ModelConfig: the base, a causal-LM folder (its backbone is loaded, the head
              initialised) or a reward-model folder (training continues)
    rm        RewardRunConfig (here): head init, margin, how to build a missing base
    learner   LearnerConfig: the RL learner's group, optimizer, LoRA, batching keys
    trainer   TrainerConfig: steps, output_dir, save_freq, test_freq, resume, seed, device
    logging   LoggingConfig: metrics.jsonl, wandb, TensorBoard, console
    ray       RayConfig: the cluster and the learner-node resource

The reused sections accept only the keys a reward-model run uses (``RM_KEYS``): a PPO
key such as ``learner.kl.use_kl_loss`` here is a mistake, refused with one line naming
it and the accepted keys, as an unknown key is.

    cfg = load_rm_config("configs/demo_rm_cpu.yaml", ["learner.optim.lr=1e-5"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from fleetrl.config import ConfigError, apply_overrides, convert, load_yaml
from fleetrl.data.config import PreferenceDataConfig
from fleetrl.models.config import ModelConfig
from launcher.config import LoggingConfig, RayConfig, RunConfig, TrainerConfig
from learner.config import LearnerConfig
from rollout_fleet.config import RolloutConfig

# The keys of the reused sections a reward-model run reads; the others are refused.
RM_KEYS: dict[str, frozenset[str]] = {
    "model": frozenset({"path", "dtype", "create_tiny", "tiny", "gradient_checkpointing"}),
    "learner": frozenset(
        {
            "num_ranks",
            "cpus_per_rank",
            "gpus_per_rank",
            "optim",
            "lora",
            "use_dynamic_bsz",
            "max_tokens_per_micro_batch",
            "micro_batch_size",
            "packing",
            "packed_row_tokens",
            "param_offload",
            "optimizer_offload",
            "mixed_precision",
            "grad_checkpointing",
            "reshard_after_forward",
            "distributed_timeout_s",
        }
    ),  # fmt: skip
    "trainer": frozenset(
        {
            "total_steps",
            "output_dir",
            "save_freq",
            "test_freq",
            "resume",
            "seed",
            "device",
            "max_bad_steps",
        }
    ),  # fmt: skip
}


class RewardRunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    head_init_std: Annotated[
        float,
        Meta(
            ge=0,
            description="Std of the score head's normal init when the base folder has no head (0 = 1/(hidden_size + 1), OpenRLHF's).",
        ),
    ] = 0.0
    use_margin: Annotated[
        bool,
        Meta(
            description="Subtract the data's margin column inside the loss, -log σ(r_c - r_r - margin); off = plain Bradley-Terry."
        ),
    ] = True
    policy_config: Annotated[
        str,
        Meta(
            description="A `fleetrl train` config whose preparation (its synthetic data and warm-started tiny model, launcher/prepare.py) builds model.path when it is missing, so the reward model starts from the very model that RL run trains; its model.path must be this one's."
        ),
    ] = ""


class RmRunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    data: PreferenceDataConfig = msgspec.field(default_factory=PreferenceDataConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    rm: RewardRunConfig = msgspec.field(default_factory=RewardRunConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    trainer: TrainerConfig = msgspec.field(
        default_factory=lambda: TrainerConfig(output_dir="runs/rm")
    )
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


def check_rm_keys(raw: dict[str, Any]) -> None:
    """Refuse a key of a reused section that a reward-model run does not read."""
    for section, allowed in RM_KEYS.items():
        given = raw.get(section)
        if not isinstance(given, dict):
            continue
        for key in given:
            if key not in allowed:
                raise ConfigError(
                    f"{section}.{key}",
                    f"not a key of `fleetrl rm train`; accepted keys: {', '.join(sorted(allowed))}",
                )


def load_rm_config(path: str | Path | None, overrides: list[str] | None = None) -> RmRunConfig:
    """YAML + dotted overrides -> a validated ``RmRunConfig`` (``ConfigError`` on any problem)."""
    raw = load_yaml(path) if path else {}
    raw = apply_overrides(raw, overrides or [])
    check_rm_keys(raw)
    cfg = convert(RmRunConfig, raw)
    if not cfg.data.train_files:
        raise ConfigError("data.train_files", "give at least one preference Parquet file")
    synth = cfg.data.synth_task
    if synth and (len(cfg.data.train_files) != 1 or len(cfg.data.val_files) > 1):
        raise ConfigError(
            "data.train_files", "with data.synth_task, give one train file and at most one val file"
        )
    return cfg


def placement_config(cfg: RmRunConfig) -> RunConfig:
    """The RM run as ``launcher.placement`` sees a run: its learner group and no engines."""
    return RunConfig(
        model=cfg.model,
        learner=cfg.learner,
        trainer=cfg.trainer,
        logging=cfg.logging,
        ray=cfg.ray,
        rollout=RolloutConfig(cpus_per_engine=0.0),  # no engine asks for a CPU
    )
