"""Run preparation: make what a config asks for but does not find on disk.

For the CPU demo and tests the run config may point at a model folder and
datasets that do not exist yet: with ``model.create_tiny`` the tiny random-init
model is built there (and optionally warm-started by supervision, see
``learner.sft``); with ``data.synth_task`` the synthetic train/test Parquet
files are generated. Real runs point at existing folders and files, and a
missing one is a clear error naming the config key.
"""

from __future__ import annotations

from pathlib import Path

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

    examples = []
    for path in cfg.data.train_files:
        table = pq.read_table(path, columns=["prompt", "reward_model"])
        for prompt, reward in zip(
            table.column("prompt").to_pylist(),
            table.column("reward_model").to_pylist(),
            strict=True,
        ):
            examples.append(
                (
                    [{"role": m["role"], "content": m["content"]} for m in prompt],
                    str(reward["ground_truth"]),
                )
            )
    return examples


def prepare(cfg: RunConfig) -> None:
    ensure_data(cfg)
    ensure_model(cfg)
