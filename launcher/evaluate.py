"""``fleetrl eval``: score saved policies on the held-out set, after (or beside) a run.

Each model folder (a policy snapshot from ``trainer.save_hf_freq``, an export, or
any Hugging Face folder of the run's architecture) is scored by
``RolloutWorker.validate``: the same prompts (``data.val_files``,
``data.val_max_samples``, the run's chat template and prompt limit), the same
sampling (``rollout.val_temperature``, greedy by default), the same reward
functions and the same metrics (``val/score/mean`` and per data source) as
in-run validation, so the two can be compared.

One engine serves them all: an embedded engine in this process, started on the
first folder, or a running server named by ``--engine-url`` (SGLang, or an
embedded engine; ``--api-key`` its bearer key). Each folder is loaded into it in
place with SGLang's ``/update_weights_from_disk`` (the path must be one the
server can read), so a run's 21 snapshots cost one engine start, not 21. The
folders must share the first one's architecture (the engine refuses other
shapes) and tokenizer (checked here: its files must be byte-identical).

Why offline: in-run validation blocks the learner while the fleet keeps
generating (see learner/snapshot.py); scoring snapshots afterwards takes no time
from the run at any η, which is what a time-to-score comparison between
staleness bounds needs (``bench.accuracy``).

Run: ``fleetrl eval --config RUN.yaml --model DIR [--model DIR ...]`` (or
``--snapshots RUN_DIR``, every snapshot of a run; ``--engine-url URL`` to score
on a running server); one JSON line per model on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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


async def _score(cfg: RunConfig, url: str, tokenizer: Any, api_key: str | None) -> dict[str, float]:
    from fleetrl.data.reader import PromptReader
    from rollout_fleet.client import EngineClient
    from rollout_fleet.membership import Membership
    from rollout_fleet.rewards.model_scorer import servers_from_urls
    from rollout_fleet.rewards.pipeline import build_reward_pipeline
    from rollout_fleet.router import Router
    from rollout_fleet.worker import RolloutWorker

    membership = Membership()
    membership.launch(ENGINE_NAME, url)
    membership.weights_loaded(ENGINE_NAME, 0)
    client = EngineClient(url, api_key=api_key, timeout_s=cfg.rollout.request_timeout_s)
    rewards = build_reward_pipeline(
        cfg.reward,
        timeout_s=cfg.rollout.reward_timeout_s,
        max_workers=cfg.rollout.reward_workers,
        model_servers=servers_from_urls(cfg.reward.model.urls),
        reward_api_key=cfg.reward.model.api_key(os.environ),
        engines=membership.urls,
        engine_api_key=api_key,
    )
    worker = RolloutWorker(
        cfg.rollout,
        engines={ENGINE_NAME: client},
        router=Router(membership),
        reader=iter(()),
        sender=_NoTrajectories(),
        admission_source=_no_admission,
        rewards=rewards,
        tokenizer=tokenizer,
    )
    reader = PromptReader(cfg.data.val_files, tokenizer, shuffle=False, **cfg.data.reader_options())
    try:
        validation = await worker.validate(reader.iter_once(cfg.data.val_max_samples))
        return validation.metrics
    finally:
        await client.close()
        await rewards.aclose()


def tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The folder's tokenizer files (``tokenizer*``, ``vocab*``, ``merges.txt``,
    ``special_tokens_map.json``) by name, with their bytes."""
    folder = Path(model_dir)
    patterns = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json")
    return {
        f.name: f.read_bytes() for pattern in patterns for f in folder.glob(pattern) if f.is_file()
    }


def _check_inputs(cfg: RunConfig, model_dirs: Sequence[str | Path]) -> None:
    if not cfg.data.val_files:
        raise ValueError("data.val_files is empty; name the held-out Parquet files")
    if not model_dirs:
        raise ValueError("no model folders to score")
    missing = [str(Path(d).absolute()) for d in model_dirs if not (Path(d) / "config.json").is_file()]  # fmt: skip
    if missing:
        raise ValueError(f"no Hugging Face model (config.json) in {', '.join(missing)}")
    first = tokenizer_files(model_dirs[0])
    for model_dir in model_dirs[1:]:
        if tokenizer_files(model_dir) != first:
            raise ValueError(
                f"the tokenizer of {model_dir} differs from {model_dirs[0]}'s;"
                " one engine scores folders of one tokenizer (run eval once per model family)"
            )


@contextlib.contextmanager
def _engine(cfg: RunConfig, first_model: str, engine_url: str | None) -> Iterator[str]:
    """The URL of the engine to score on: ``engine_url``, or an embedded engine started here."""
    if engine_url:
        yield engine_url
        return
    from rollout_fleet.engine.server import EmbeddedEngine

    engine = EmbeddedEngine(
        first_model,
        engine_id=ENGINE_NAME,
        device=resolve_device(cfg),
        max_running_requests=cfg.rollout.max_running_requests,
        dtype=cfg.model.dtype,
    )
    try:
        yield engine.start_server()
    finally:
        engine.stop()


def evaluate(
    cfg: RunConfig,
    model_dirs: Sequence[str | Path],
    *,
    engine_url: str | None = None,
    api_key: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield ``{"model": dir, **validation metrics}`` for each folder, in order.

    Raises ``ValueError`` when the config names no validation files, a folder
    holds no model or the tokenizers differ, before anything is served; an
    engine that refuses a folder raises ``EngineCallError`` naming it.
    """
    from fleetrl.models.loading import load_tokenizer
    from weight_sync.engine_client import EngineClient, EngineEndpoint

    _check_inputs(cfg, model_dirs)
    folders = [str(Path(d).resolve()) for d in model_dirs]
    tokenizer = load_tokenizer(folders[0])
    with _engine(cfg, folders[0], engine_url) as url:
        control = EngineClient(
            EngineEndpoint(ENGINE_NAME, url, api_key=api_key), cfg.rollout.request_timeout_s
        )
        try:
            for index, folder in enumerate(folders):
                if index > 0 or engine_url:  # an embedded engine starts on the first
                    control.update_weights_from_disk(folder)
                metrics = asyncio.run(_score(cfg, url, tokenizer, api_key))
                log.info("%s: held-out score %s", folder, metrics.get("val/score/mean"))
                yield {"model": str(model_dirs[index]), **metrics}
        finally:
            control.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", action="append", default=[], help="a Hugging Face model folder (repeatable)"
    )
    p.add_argument(
        "--snapshots",
        default="",
        help="a run folder: score every policy snapshot under RUN/hf_snapshots, by step",
    )
    p.add_argument(
        "--engine-url",
        default="",
        help="score on this running server (SGLang or embedded), loading each folder with"
        " /update_weights_from_disk (it serves the last one afterwards); default: an embedded"
        " engine in this process",
    )
    p.add_argument("--api-key", default=None, help="the --engine-url server's bearer key")


def main(args: argparse.Namespace) -> int:
    from launcher.cli import UsageError
    from learner.snapshot import snapshot_root, snapshot_steps
    from weight_sync.engine_client import EngineCallError

    cfg = load_run_config(args.config, args.overrides)
    models = list(args.model)
    if args.snapshots:
        found = snapshot_steps(snapshot_root(args.snapshots))
        if not found:
            raise UsageError(
                f"no policy snapshots under {Path(args.snapshots).absolute()}: a run writes them "
                "to <run dir>/hf_snapshots with trainer.save_hf_freq=N (every N steps)"
            )
        models += [str(path) for _, path in found]
    if not models:
        raise UsageError("name at least one --model folder or --snapshots RUN_DIR")
    try:
        for record in evaluate(
            cfg, models, engine_url=args.engine_url or None, api_key=args.api_key
        ):
            sys.stdout.write(json.dumps(record) + "\n")  # CLI output, one line per model
            sys.stdout.flush()
    except ValueError as err:
        raise UsageError(str(err)) from None
    except EngineCallError as err:  # the engine refused a folder or did not answer
        raise UsageError(str(err)) from None
    return 0
