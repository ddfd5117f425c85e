"""``fleetrl eval``: score saved policies on the held-out set, after (or beside) a run.

Each model folder (a policy snapshot from ``trainer.save_hf_freq``, an export, or
any Hugging Face folder of the run's architecture) is served by an embedded
engine in this process and scored by ``RolloutWorker.validate``: the same
prompts (``data.val_files``, ``data.val_max_samples``, the run's chat template
and prompt limit), the same sampling (``rollout.val_temperature``, greedy by
default), the same reward functions and the same metrics (``val/score/mean``
and per data source) as in-run validation, so the two can be compared.

Why offline: in-run validation blocks the learner while the fleet keeps
generating (see learner/snapshot.py); scoring snapshots afterwards takes no time
from the run at any η, which is what a time-to-score comparison between
staleness bounds needs (``bench.accuracy``).

Run: ``fleetrl eval --config RUN.yaml --model DIR [--model DIR ...]`` (or
``--snapshots RUN_DIR``, every snapshot of a run); one JSON line per model on
stdout. Left out: SGLang engines (the embedded engine runs on CPU or one GPU;
for a large model, serve the snapshot with SGLang and point a run's
validation at it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger
from launcher.config import RunConfig, load_run_config, resolve_device

log = get_logger(__name__)

ENGINE_NAME = "eval"


class _NoTrajectories:
    """The worker's trajectory sink; scoring sends none, so any use is a bug."""

    def send(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("fleetrl eval sends no trajectories")


def _no_admission() -> Any:
    raise RuntimeError("fleetrl eval starts no training groups")


async def _score(cfg: RunConfig, url: str, tokenizer: Any) -> dict[str, float]:
    from fleetrl.data.reader import PromptReader
    from rollout_fleet.client import EngineClient
    from rollout_fleet.membership import Membership
    from rollout_fleet.rewards.runner import RewardRunner
    from rollout_fleet.router import Router
    from rollout_fleet.worker import RolloutWorker

    membership = Membership()
    membership.launch(ENGINE_NAME, url)
    membership.weights_loaded(ENGINE_NAME, 0)
    client = EngineClient(url, timeout_s=cfg.rollout.request_timeout_s)
    worker = RolloutWorker(
        cfg.rollout,
        engines={ENGINE_NAME: client},
        router=Router(membership),
        reader=iter(()),
        sender=_NoTrajectories(),
        admission_source=_no_admission,
        reward_runner=RewardRunner(
            timeout_s=cfg.rollout.reward_timeout_s, max_workers=cfg.rollout.reward_workers
        ),
        tokenizer=tokenizer,
    )
    reader = PromptReader(
        cfg.data.val_files,
        tokenizer,
        shuffle=False,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    try:
        return await worker.validate(reader.iter_once(cfg.data.val_max_samples))
    finally:
        await client.close()


def evaluate(cfg: RunConfig, model_dirs: Sequence[str | Path]) -> Iterator[dict[str, Any]]:
    """Yield ``{"model": dir, **validation metrics}`` for each folder, in order.

    Raises ``ValueError`` when the config names no validation files or a folder
    holds no model, before anything is served.
    """
    from fleetrl.models.loading import load_tokenizer
    from rollout_fleet.engine.server import EmbeddedEngine

    if not cfg.data.val_files:
        raise ValueError("fleetrl eval: data.val_files is empty; name the held-out Parquet files")
    missing = [str(d) for d in model_dirs if not (Path(d) / "config.json").is_file()]
    if missing:
        raise ValueError(f"fleetrl eval: no Hugging Face model (config.json) in {missing}")
    device = resolve_device(cfg)
    for model_dir in model_dirs:
        engine = EmbeddedEngine(
            str(model_dir),
            engine_id=ENGINE_NAME,
            device=device,
            max_running_requests=cfg.rollout.max_running_requests,
            dtype=cfg.model.dtype,
        )
        try:
            url = engine.start_server()
            metrics = asyncio.run(_score(cfg, url, load_tokenizer(str(model_dir))))
        finally:
            engine.stop()
        log.info("%s: held-out score %s", model_dir, metrics.get("val/score/mean"))
        yield {"model": str(model_dir), **metrics}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", action="append", default=[], help="a Hugging Face model folder (repeatable)"
    )
    p.add_argument(
        "--snapshots",
        default="",
        help="a run folder: score every policy snapshot under RUN/hf_snapshots, by step",
    )


def main(args: argparse.Namespace) -> int:
    from launcher.cli import UsageError
    from learner.snapshot import snapshot_root, snapshot_steps

    cfg = load_run_config(args.config, args.overrides)
    models = list(args.model)
    if args.snapshots:
        found = snapshot_steps(snapshot_root(args.snapshots))
        if not found:
            raise UsageError(f"fleetrl eval: no policy snapshots under {args.snapshots}")
        models += [str(path) for _, path in found]
    if not models:
        raise UsageError("fleetrl eval: name at least one --model folder or --snapshots RUN_DIR")
    try:
        for record in evaluate(cfg, models):
            sys.stdout.write(json.dumps(record) + "\n")  # CLI output, one line per model
            sys.stdout.flush()
    except ValueError as err:
        raise UsageError(str(err)) from None
    return 0
