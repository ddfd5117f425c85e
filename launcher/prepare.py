"""Run preparation: make what a config asks for but does not find on disk.

For the CPU demo and tests the run config may point at a model folder and
datasets that do not exist yet: with ``model.create_tiny`` the tiny random-init
model is built there (and optionally warm-started by supervision, see
``learner.sft``); with ``data.synth_task`` the synthetic train/test Parquet
files are generated. Real runs point at existing folders and files, and a
missing one is a clear error naming the config key.

Once the data exists, ``trainer.total_epochs`` becomes a step count
(``resolve_total_steps``): verl's rule, ⌊prompts ÷ batch⌋ steps per epoch.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from fleetrl.config import ConfigError
from fleetrl.log import get_logger
from launcher.config import RunConfig, resolve_device

log = get_logger(__name__)


def ensure_data(cfg: RunConfig) -> None:
    data = cfg.data
    missing = [f for f in data.train_files + data.val_files if not Path(f).is_file()]
    if not missing:
        return
    if not data.synth_task:
        raise ConfigError(
            "data.train_files",
            f"file not found: {missing[0]} (set data.synth_task to generate a synthetic task)",
        )
    from fleetrl.data.synth import write_synth_dataset

    if len(data.train_files) != 1 or len(data.val_files) > 1:
        raise ConfigError(
            "data.train_files", "with data.synth_task, give one train file and at most one val file"
        )
    out_dir = Path(data.train_files[0]).parent
    train, test = write_synth_dataset(
        data.synth_task, out_dir, data.synth_train_size, data.synth_test_size, data.seed
    )
    Path(train).replace(data.train_files[0]) if Path(train) != Path(data.train_files[0]) else None
    if data.val_files and Path(test) != Path(data.val_files[0]):
        Path(test).replace(data.val_files[0])
    log.debug("generated synthetic task %r into %s", data.synth_task, out_dir)


def ensure_model(cfg: RunConfig) -> None:
    model_dir = Path(cfg.model.path)
    if (model_dir / "config.json").is_file():
        return
    if not cfg.model.create_tiny:
        raise ConfigError(
            "model.path",
            f"{model_dir} is not a Hugging Face model folder (set model.create_tiny to build a tiny one)",
        )
    from fleetrl.models.tiny import make_tiny_model

    spec = cfg.model.tiny
    tmp = model_dir.with_name(model_dir.name + ".partial")
    make_tiny_model(
        tmp,
        arch=spec.arch,
        layers=spec.layers,
        hidden=spec.hidden,
        heads=spec.heads,
        max_positions=spec.max_positions,
        seed=spec.seed,
    )
    if cfg.model.warmstart.steps:
        from learner.sft import supervised_warmstart

        examples = _warmstart_examples(cfg)
        device = resolve_device(cfg)
        loss = supervised_warmstart(tmp, examples, cfg.model.warmstart, device=device)
        log.info(
            "warm start: %d steps on %d examples (label noise %.2f) on %s, final loss %.3f",
            cfg.model.warmstart.steps,
            len(examples),
            cfg.model.warmstart.label_noise,
            device,
            loss,
        )
    tmp.replace(model_dir)  # the folder appears complete or not at all
    log.info("built tiny %s model at %s", spec.arch, model_dir)


def _warmstart_examples(cfg: RunConfig) -> list[tuple[list[dict[str, str]], str]]:
    import pyarrow.parquet as pq

    from fleetrl.models.reward_input import prompt_messages  # a plain string: one user turn

    examples = []
    for path in cfg.data.train_files:
        table = pq.read_table(path, columns=["prompt", "reward_model"])
        for prompt, reward in zip(
            table.column("prompt").to_pylist(),
            table.column("reward_model").to_pylist(),
            strict=True,
        ):
            examples.append((prompt_messages(prompt), str(reward["ground_truth"])))
    return examples


def count_train_prompts(cfg: RunConfig) -> int:
    """Training prompts of one epoch as the rollout side's reader will keep them.

    With ``data.truncation=filter`` each prompt is rendered and measured (as verl does for
    ``filter_overlong_prompts``); otherwise every row (or ``train_max_samples`` of them) stays.
    """
    data = cfg.data
    if data.truncation == "filter":
        from fleetrl.data.reader import PromptReader
        from fleetrl.models.loading import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
        reader = PromptReader(
            data.train_files, tokenizer, shuffle=data.shuffle, seed=data.seed,
            max_samples=data.train_max_samples, **data.reader_options(),
        )  # fmt: skip
        return len(reader)
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in data.train_files)
    return min(rows, data.train_max_samples) if data.train_max_samples > 0 else rows


def resolve_total_steps(cfg: RunConfig, prompts: int | None = None) -> RunConfig:
    """``cfg`` with ``trainer.total_steps`` from ``trainer.total_epochs`` when that is set.

    verl: ``len(train_dataloader) × total_epochs``, the dataloader batching
    ``data.train_batch_size`` prompts with ``drop_last=True``.
    """
    trainer = cfg.trainer
    if trainer.total_epochs <= 0:
        return cfg
    prompts = count_train_prompts(cfg) if prompts is None else prompts
    per_epoch = prompts // cfg.data.train_batch_size
    if per_epoch == 0:
        raise ConfigError(
            "trainer.total_epochs",
            f"data.train_files hold {prompts} prompts, fewer than one batch of "
            f"data.train_batch_size={cfg.data.train_batch_size}: no step would run",
        )
    steps = per_epoch * trainer.total_epochs
    log.info(
        "trainer.total_epochs=%d: %d steps (%d prompts, %d steps per epoch of %d prompts)",
        trainer.total_epochs, steps, prompts, per_epoch, cfg.data.train_batch_size,
    )  # fmt: skip
    return msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(trainer, total_steps=steps))


def prepare(cfg: RunConfig) -> RunConfig:
    """Build what is missing, then resolve what depends on the data: the config to run."""
    ensure_data(cfg)
    ensure_model(cfg)
    return resolve_total_steps(cfg)
