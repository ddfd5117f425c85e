"""The Ray actor of a reward-model run: one rank of the learner group, a thin shell around
``learner.reward_worker.RewardModelWorker``.

Rank 0 also holds the data (``fleetrl.data.pairs``): the tokenized training pairs and
their epoch cursor, and the held-out pairs. Each ``step`` takes the next
``data.train_batch_size`` pairs and hands their Arrow batch to the worker, which
broadcasts it to the other ranks as IPC bytes: no batch travels through Ray, and the
other ranks need no copy of the files. The cursor goes into every checkpoint, so a
resumed run trains on the pairs the uninterrupted one would have.

Calls the driver branches on return typed results (``RmStepResult``, ``DataSummary``,
``learner.bradley_terry.PairScores``); every call but ``master_address`` and ``pid`` is a
collective of the whole group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from fleetrl.config import convert
from fleetrl.log import get_logger, setup_logging
from fleetrl.threads import role_threads
from launcher.rm_config import RmRunConfig
from launcher.roles import free_port, node_ip

log = get_logger(__name__)


class RmStepResult(msgspec.Struct, frozen=True, kw_only=True):
    """One optimizer step, as rank 0 saw it."""

    skipped_nonfinite: bool = False  # the update was skipped (non-finite loss or gradient)
    epoch: int = 0  # the data epoch the next pair comes from
    metrics: dict[str, float] = {}  # for logging only


class DataSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The preference data rank 0 loaded: pairs kept, and dropped by reason."""

    train_pairs: int
    train_dropped: dict[str, int]
    val_pairs: int = 0
    val_dropped: dict[str, int] = {}

    def lines(self) -> list[str]:
        def drops(counts: dict[str, int]) -> str:
            return ", ".join(f"{n} {reason}" for reason, n in counts.items() if n) or "none"

        out = [f"training pairs: {self.train_pairs} (dropped: {drops(self.train_dropped)})"]
        if self.val_pairs:
            out.append(f"held-out pairs: {self.val_pairs} (dropped: {drops(self.val_dropped)})")
        return out


class RewardTrainerRole:
    def __init__(self, raw: dict[str, Any], rank: int, world_size: int, local: bool):
        cfg = convert(RmRunConfig, raw)
        setup_logging(f"rm:{rank}", cfg.logging.level)
        import torch

        if cfg.trainer.device != "cuda":
            torch.set_num_threads(role_threads(cfg.learner.cpus_per_rank))
        self.cfg, self.rank, self.world_size, self.local = cfg, rank, world_size, local
        self.worker: Any = None
        self.train: Any = None  # rank 0: fleetrl.data.pairs.PreferencePairs
        self.val: Any = None
        self.cursor: Any = None

    def pid(self) -> int:
        return os.getpid()

    def master_address(self) -> tuple[str, int]:
        host = node_ip(self.local)
        return host, free_port(host)

    def setup(self, master: tuple[str, int], device: str) -> DataSummary | None:
        """Collective: build the worker; rank 0 reads and tokenizes the data (its summary)."""
        from learner.reward_worker import RewardModelWorker

        cfg = self.cfg
        self.worker = RewardModelWorker(
            cfg.learner, cfg.model, rank=self.rank, world_size=self.world_size,
            master_addr=master[0], master_port=master[1], seed=cfg.trainer.seed, device=device,
            total_steps=cfg.trainer.total_steps, head_init_std=cfg.rm.head_init_std,
            use_margin=cfg.rm.use_margin,
        )  # fmt: skip
        self.worker.setup()
        if self.rank != 0:
            return None
        from fleetrl.data.pairs import PairCursor, PreferencePairs
        from fleetrl.models.loading import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
        read = dict(
            max_length=cfg.data.max_length, apply_chat_template=cfg.data.apply_chat_template
        )
        self.train = PreferencePairs(cfg.data.train_files, tokenizer, **read)
        self.val = PreferencePairs(cfg.data.val_files, tokenizer, **read) if cfg.data.val_files else None  # fmt: skip
        self.cursor = PairCursor(len(self.train), shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        if self.val is None:
            log.warning(
                "no data.val_files: held-out figures and the exported folder's score "
                "statistics come from the first data.val_max_pairs training pairs"
            )
        return DataSummary(
            train_pairs=len(self.train), train_dropped=dict(self.train.dropped),
            val_pairs=len(self.val) if self.val else 0,
            val_dropped=dict(self.val.dropped) if self.val else {},
        )  # fmt: skip

    def step(self) -> RmStepResult:
        """Collective: one optimizer step on the next pairs of rank 0's cursor."""
        batch = None
        if self.rank == 0:
            batch = self.train.to_arrow(self.cursor.take(self.cfg.data.train_batch_size))
        metrics = self.worker.step(batch)
        if self.rank != 0:
            return RmStepResult()
        metrics["train/epoch"] = float(self.cursor.epoch)
        return RmStepResult(
            skipped_nonfinite=metrics["train/skipped_nonfinite"] > 0,
            epoch=self.cursor.epoch,
            metrics=metrics,
        )

    def evaluate(self) -> Any:
        """Collective: ``PairScores`` of the held-out pairs (rank 0; the others None).

        Without held-out files, the training pairs (their first ``data.val_max_pairs``).
        """
        import numpy as np

        from learner.bradley_terry import summarize_pairs

        batch = None
        if self.rank == 0:
            pairs = self.val if self.val is not None else self.train
            count = len(pairs) if self.cfg.data.val_max_pairs < 0 else min(self.cfg.data.val_max_pairs, len(pairs))  # fmt: skip
            batch = pairs.to_arrow(np.arange(count))
        chosen, rejected = self.worker.score(batch)
        if self.rank != 0:
            return None
        margin = batch.column("margin").to_numpy() if self.cfg.rm.use_margin else None
        return summarize_pairs(chosen, rejected, margin)

    def save_checkpoint(self, root: str) -> str:
        """Collective: a checkpoint of the model, optimizer, schedule and data cursor."""
        extra = {"cursor": self.cursor.state_dict()} if self.rank == 0 else {}
        return str(self.worker.save_checkpoint(root, extra))

    def load_checkpoint(self, step_dir: str) -> int:
        """Collective: restore everything ``save_checkpoint`` wrote; returns the step."""
        extra = self.worker.load_checkpoint(step_dir)
        if self.rank == 0:
            self.cursor.load_state_dict(extra["cursor"])
        return self.worker.global_step

    def export(self, out_dir: str, stats: Any) -> str:
        """Collective: the reward-model folder (``learner.reward_export``); rank 0 writes."""
        from learner.reward_export import write_reward_model

        path = write_reward_model(
            self.worker.named_full_tensors(), base_path=self.cfg.model.path,
            out_dir=out_dir, rank=self.rank, stats=stats,
        )  # fmt: skip
        return str(Path(path))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
