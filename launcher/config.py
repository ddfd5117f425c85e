"""The run config: one typed section per component, composed here.

``load_run_config(path, overrides)`` reads YAML, applies dotted overrides
(``learner.optim.lr=1e-6``) and validates everything, raising ``ConfigError``
with the dotted path on any problem.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from buffer.admission import derive_groups_per_version
from buffer.config import BufferConfig
from fleetrl.config import ConfigError, apply_overrides, convert, load_yaml
from fleetrl.data.config import DataConfig
from fleetrl.models.config import ModelConfig
from learner.config import LearnerConfig
from rollout_fleet.config import RolloutConfig
from rollout_fleet.rewards.config import RewardConfig
from weight_sync.config import WeightSyncConfig


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    total_steps: Annotated[
        int, Meta(ge=1, description="Learner steps to run (unless total_epochs is set).")
    ] = 100
    total_epochs: Annotated[
        int,
        Meta(
            ge=0,
            description="When > 0, passes over data.train_files (verl's trainer.total_epochs): total_steps becomes total_epochs × ⌊prompts ÷ data.train_batch_size⌋, counted from the files when the run starts, with the prompts data.truncation=filter drops left out and a last partial batch not a step (verl's dataloader drops it). 0 = total_steps decides.",
        ),
    ] = 0
    output_dir: Annotated[
        str,
        Meta(
            description="Run directory: resolved config, metrics.jsonl, checkpoints, rollout bank, plots."
        ),
    ] = "runs/default"
    save_freq: Annotated[
        int,
        Meta(
            ge=-1,
            description="Checkpoint every this many steps and at the last step; -1 = only at the last step (and on a stop signal); 0 = never, not even on a stop (verl's save_freq: -1 maps to 0).",
        ),
    ] = -1
    keep_checkpoints: Annotated[
        int,
        Meta(
            ge=0,
            description="Keep only the newest this many complete checkpoints (0 = all; at least 2 are kept, for the fallback to the previous one). Older ones cannot be resumed once the buffer has committed past them.",
        ),
    ] = 0
    test_freq: Annotated[
        int,
        Meta(
            ge=-1,
            description="Validate every this many steps and at the last step (-1 = never); validation before the first step is val_before_train's.",
        ),
    ] = -1
    val_before_train: Annotated[
        bool,
        Meta(
            description="Validate once before the first step (verl's trainer.val_before_train), whatever test_freq says; needs data.val_files. Not repeated when a run resumes.",
        ),
    ] = True
    save_hf_freq: Annotated[
        int,
        Meta(
            ge=-1,
            description="Write the policy as a Hugging Face folder (safetensors, config, tokenizer) to <output_dir>/hf_snapshots/step_<N> before the first step and every this many steps (-1 = never). Costs one gather and a file write, the same at every staleness bound, so held-out scores computed afterwards (`fleetrl eval`) take no time from the run, as in-run validation does.",
        ),
    ] = -1
    resume: Annotated[
        Literal["auto", "disable"],
        Meta(description="auto: continue from the latest complete checkpoint in output_dir."),
    ] = "auto"
    resume_from_path: Annotated[
        str,
        Meta(
            description="A checkpoint folder (<run dir>/checkpoints/step_N, of this run or another) to start from instead of the newest in output_dir (verl's resume_mode=resume_path); ~ is expanded. Its policy, optimizer, critic, LR schedule, step and data cursor are loaded; the rollout bank starts empty (groups generated but not trained on are generated again) and output_dir's checkpoints newer than it are moved aside, so a later resume=auto continues this branch.",
        ),
    ] = ""
    seed: Annotated[int, Meta(description="Global seed.")] = 1
    device: Annotated[
        Literal["auto", "cpu", "cuda"], Meta(description="Where learner and engines compute.")
    ] = "auto"
    log_val_generations: Annotated[
        int,
        Meta(
            ge=0,
            description="Validation samples written per validation to <run dir>/generations.jsonl (step, prompt, response, score, data_source, ground truth, policy version, ...) and, with logging.wandb, to a wandb table (verl's trainer.log_val_generations); 0 = none. The same prompts each time (a seeded choice), so a sample's answers can be followed across steps.",
        ),
    ] = 0
    profile_steps: Annotated[
        list[int],
        Meta(
            description="Steps (counted from 1) to profile with torch.profiler (verl's global_profiler.steps): each learner rank writes <run dir>/profile/step_<N>/learner_rank<r>.json, a Chrome trace (chrome://tracing, Perfetto), and each embedded engine its own for the same span.",
        ),
    ] = []
    max_bad_steps: Annotated[
        int,
        Meta(
            ge=1,
            description="Stop after this many consecutive steps with a non-finite loss (each is skipped and logged).",
        ),
    ] = 3


class LoggingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description="Log level of every role.")
    ] = "INFO"
    wandb: Annotated[
        bool,
        Meta(
            description="Log to Weights & Biases (respects WANDB_MODE; offline works without network)."
        ),
    ] = False
    project: Annotated[str, Meta(description="wandb project.")] = "fleetrl"
    run_name: Annotated[
        str, Meta(description="wandb / run display name (default: output_dir's name).")
    ] = ""
    tensorboard: Annotated[
        bool, Meta(description="Also write TensorBoard event files to <run dir>/tensorboard.")
    ] = False
    mlflow: Annotated[
        bool,
        Meta(
            description="Also log metrics and the resolved config (as params) to MLflow, at MLFLOW_TRACKING_URI or else a SQLite store at <run dir>/mlflow.db; the experiment is logging.project, the run logging.run_name."
        ),
    ] = False
    console_every: Annotated[
        int, Meta(ge=1, description="Print a progress line every this many steps.")
    ] = 5
    role_console: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR"],
        Meta(
            description="Lowest level of the roles' (Ray actors') log lines shown on the console; every line at `level` goes to <run dir>/logs/<role>.log."
        ),
    ] = "WARNING"


class RayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    address: Annotated[
        str, Meta(description="Ray cluster address; empty = RAY_ADDRESS or a new local instance.")
    ] = ""
    num_cpus: Annotated[int, Meta(ge=0, description="CPUs of a local instance (0 = all).")] = 0
    num_gpus: Annotated[int, Meta(ge=0, description="GPUs of a local instance.")] = 0
    rollout_resource: Annotated[
        str, Meta(description="Custom resource that marks rollout nodes.")
    ] = "rollout"
    learner_resource: Annotated[
        str, Meta(description="Custom resource that marks learner nodes.")
    ] = "learner"
    reward_resource: Annotated[
        str, Meta(description="Custom resource that marks reward-model server nodes.")
    ] = "reward"
    placement_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Longest wait for the learner group and the engines to be placed; then the run stops with one line saying what is missing where (a line every few seconds says what it waits for meanwhile).",
        ),
    ] = 600.0
    autoscaling: Annotated[
        bool,
        Meta(
            description="The cluster starts nodes on demand (ray up, KubeRay autoscaling): resources the current nodes lack are a preflight warning, not an error, and placement_timeout_s bounds the wait for new nodes.",
        ),
    ] = False


class RunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)

    @property
    def groups_per_version(self) -> int:
        """B of the admission rule: groups the learner consumes per published version."""
        return derive_groups_per_version(self.data.train_batch_size, self.weight_sync.sync_every)


def load_run_config(
    path: str | Path | None, overrides: list[str] | None = None, *, training: bool = False
) -> RunConfig:
    """YAML + dotted overrides -> a validated ``RunConfig``, cross-section rules included.

    A file (or command line) in verl's layout is read with verl's meaning
    (``launcher.verl``). ``training`` also applies the rules only a training run needs
    (``launcher.config_rules``).
    """
    return load_run_config_named(path, overrides, training=training)[0]


def load_run_config_named(
    path: str | Path | None, overrides: list[str] | None = None, *, training: bool = False
) -> tuple[RunConfig, Callable[[str], str]]:
    """``load_run_config``, and how to name a fleetrl key to the user: for a verl config, the
    verl key it came from (``"trainer.n_gpus_per_node (fleetrl learner.num_ranks)"``)."""
    from launcher.verl.load import is_verl_layout, load_verl

    raw = load_yaml(path) if path else {}
    if is_verl_layout(raw, overrides or []):
        verl = load_verl(raw, overrides or [])
        return verl.run_config(training=training), verl.name
    cfg = build_run_config(apply_overrides(raw, overrides or []), training=training)
    return cfg, str


def build_run_config(raw: dict[str, Any], *, training: bool = False) -> RunConfig:
    """A fleetrl config dict -> a validated ``RunConfig`` (every rule of a loaded config)."""
    from launcher.config_rules import validate_run

    cfg = validate_run(convert(RunConfig, raw), training=training)
    check_run_config(cfg)
    return cfg


def resolve_device(cfg: RunConfig) -> str:
    """``trainer.device``, with ``auto`` resolved: cuda where torch sees a GPU, else cpu."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_run_config(cfg: RunConfig) -> None:
    """Checks across keys (and against the model's config.json when it exists)."""
    sp, lc = cfg.learner.sequence_parallel, cfg.learner
    if lc.num_ranks % sp:
        raise ConfigError(
            "learner.sequence_parallel",
            f"got {sp}; it must divide learner.num_ranks={lc.num_ranks}",
        )
    if sp > 1 and not lc.packing:
        raise ConfigError("learner.sequence_parallel", f"got {sp}; it needs learner.packing=true")
    if sp > 1:
        from learner.memory import ModelShape

        try:
            shape = ModelShape.from_model_config(cfg.model)
        except (FileNotFoundError, KeyError, ValueError):
            return  # checked again by the learner once the model exists
        if shape.heads % sp or shape.kv_heads % sp:
            raise ConfigError(
                "learner.sequence_parallel",
                f"got {sp}; the model's {shape.heads} attention and {shape.kv_heads} KV heads "
                "must both be divisible by it",
            )
