"""RewardModelWorker: one rank of the FSDP2 learner group training a reward model on pairs.

The reward-model counterpart of ``learner.worker.LearnerWorker``, built from the same
parts: the group (``learner.dist``), the model on the meta device with only this rank's
shards read (``learner.model_build`` with the ``reward`` kind: a one-label head without
bias over the backbone of ``model.path``, a causal LM or a reward-model folder), FSDP2,
LoRA (adapters plus the head in full), gradient checkpointing, the optimizer, schedule
and guarded step (``learner.fsdp``), the plan and forward of pairs
(``learner.pair_batch``), the Bradley-Terry loss (``learner.bradley_terry``), checkpoints
(``learner.checkpoint``'s folder) and the weights out (``learner.weights_out``). Like the
RL worker it is free of Ray: tests drive it through ``torch.multiprocessing``, the
launcher wraps it in a Ray actor.

    worker = RewardModelWorker(learner_cfg, model_cfg, rank=r, world_size=w,
                               master_addr="127.0.0.1", master_port=port, seed=1)
    worker.setup()
    metrics = worker.step(pairs_or_None)               # every rank, collectively
    chosen, rejected = worker.score(pairs_or_None)      # every rank; no gradient
    for name, tensor in worker.named_full_tensors(): ...   # every rank; rank 0 keeps them
    worker.save_checkpoint(root, extra_state) / worker.load_checkpoint(step_dir)

One ``step``: rank 0's pair batch is broadcast (Arrow IPC bytes) -> every rank plans the
same micro-batches of whole pairs and takes its share -> per micro-batch, chosen and
rejected sequences in one forward, scores at each sequence's last token, loss
Σ -log σ(r_c - r_r - m) / B × ranks, backward -> clip, step unless the loss or the norm
is not finite -> LR schedule -> metrics reduced over ranks, weighted by pairs.

Metrics (OpenRLHF's names under ``train/``): loss, acc (pairwise accuracy), chosen_reward,
reject_reward, margin (mean r_c - r_r), lr, grad_norm, skipped_nonfinite; ``perf/tokens``,
``perf/tokens_per_s``, ``timing_s/step``, ``perf/peak_memory_gb``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from fleetrl.log import get_logger
from fleetrl.models.config import ModelConfig
from fleetrl.models.config_sizes import model_sizes
from fleetrl.models.loading import check_model_dir
from learner import checkpoint as ckpt
from learner import dist as ldist
from learner import lora, weights_out
from learner.bradley_terry import bradley_terry_loss, pair_metrics
from learner.config import LearnerConfig
from learner.fsdp import build_optimizer, build_scheduler, guarded_step
from learner.memory import peak_memory_gb, rss_kb
from learner.model_build import build_model, init_value_head, stored_head
from learner.packing import MicroBatchInputs, packed_row_budget, packing_allowed, value_forward
from learner.pair_batch import PairBatch, build_pair_inputs, plan_pairs, split_scores
from learner.worker_checkpoint import frozen_base_options, scheduler_state

log = get_logger(__name__)


class RewardModelWorker:
    def __init__(
        self,
        learner_cfg: LearnerConfig,
        model_cfg: ModelConfig,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        seed: int,
        device: str = "cpu",
        total_steps: int = 0,
        head_init_std: float = 0.0,
        use_margin: bool = True,
    ) -> None:
        if learner_cfg.sequence_parallel != 1:
            raise ValueError(
                f"learner.sequence_parallel={learner_cfg.sequence_parallel}: reward-model "
                "training runs without sequence parallelism (set it to 1)"
            )
        self.cfg = learner_cfg
        self.model_cfg = model_cfg
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.seed = seed
        self.device = torch.device(device)
        self.total_steps = total_steps
        self.head_init_std = head_init_std
        self.use_margin = use_margin
        self.global_step = 0
        self.model: nn.Module | None = None
        self.head_from_folder = False  # the score head was read from model.path

    @property
    def uses_lora(self) -> bool:
        return self.cfg.lora.rank > 0

    def setup(self) -> None:
        """Join the group, build and shard the model, its head, optimizer and schedule."""
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        ldist.init_group(
            master_addr=self.master_addr, master_port=self.master_port, rank=self.rank,
            world_size=self.world_size, device=self.device, timeout_s=self.cfg.distributed_timeout_s,
        )  # fmt: skip
        torch.manual_seed(self.seed)
        np.random.seed(self.seed % 2**32)
        self._rss_before_models_kb = rss_kb()
        path = check_model_dir(self.model_cfg.path)
        on_gpu = self.device.type == "cuda"
        bf16 = self.cfg.mixed_precision == "bf16" or (self.cfg.mixed_precision == "auto" and on_gpu)
        self.model = build_model(
            path, "reward", device=self.device, train=True,
            grad_checkpointing=self.cfg.grad_checkpointing or self.model_cfg.gradient_checkpointing,
            bf16=bf16, offload=self.cfg.param_offload and on_gpu,
            reshard_after_forward=self.cfg.reshard_after_forward,
            lora_cfg=self.cfg.lora if self.uses_lora else None, seed=self.seed, sp_size=1,
        )  # fmt: skip
        stored = stored_head(path)
        self.head_from_folder = "weight" in stored
        hidden = model_sizes(self.model.config).hidden
        std = self.head_init_std or 1.0 / (hidden + 1)  # OpenRLHF's init
        init_value_head(self.model, self.seed, std, keep=stored)
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)
        self.packing = packing_allowed(self.model.config, self.cfg.packing, rank=self.rank)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, self.total_steps)

    def close(self) -> None:
        ldist.close_group()

    # ------------------------------------------------------------------ the step

    def _pairs(self, batch: pa.RecordBatch | None) -> PairBatch:
        if self.model is None:
            raise RuntimeError("RewardModelWorker used before setup()")
        arrow = ldist.broadcast_record_batch(
            batch, rank=self.rank, world_size=self.world_size, device=self.device
        )
        return PairBatch.from_arrow(arrow)

    def _plan(self, pairs: PairBatch) -> list[np.ndarray]:
        return plan_pairs(
            pairs, np.arange(pairs.size), self.world_size, self.rank,
            use_dynamic_bsz=self.cfg.use_dynamic_bsz, max_tokens=self.cfg.max_tokens_per_micro_batch,
            micro_batch_size=self.cfg.micro_batch_size, packing=self.packing,
        )  # fmt: skip

    def _inputs(self, pairs: PairBatch, indices: np.ndarray) -> MicroBatchInputs:
        row_tokens = None
        if self.packing:
            lens = np.concatenate([pairs.chosen_lens[indices], pairs.rejected_lens[indices]])
            row_tokens = packed_row_budget(self.attn_implementation, self.cfg.packed_row_tokens, lens)  # fmt: skip
        return build_pair_inputs(
            pairs, indices, packing=self.packing, device=self.device, row_tokens=row_tokens
        )

    def _margin(self, pairs: PairBatch, indices: np.ndarray) -> torch.Tensor | None:
        if not self.use_margin:
            return None
        return torch.from_numpy(pairs.margin[indices]).to(self.device)

    def step(self, batch: pa.RecordBatch | None) -> dict[str, float]:
        """One optimizer step on a batch of pairs (rank 0 passes it, other ranks None)."""
        started = time.perf_counter()
        pairs = self._pairs(batch)
        sums = ldist.MetricSums()
        loss_local = torch.zeros((), dtype=torch.float64, device=self.device)
        for indices in self._plan(pairs):
            mb = self._inputs(pairs, indices)
            scores, anchor = value_forward(self.model, mb)
            chosen, rejected = split_scores(scores, mb)
            margin = self._margin(pairs, indices)
            loss = bradley_terry_loss(
                chosen, rejected, margin, global_pair_count=pairs.size, dp_size=self.world_size
            )
            (loss + anchor).backward()
            loss_local += loss.detach()
            for key, values in pair_metrics(chosen, rejected, margin).items():
                sums.add(f"train/{key}", float(values.mean()) if len(indices) else 0.0, len(indices))  # fmt: skip
        update = guarded_step(self.model, self.optimizer, self.cfg.optim.grad_clip, loss_local)
        if not update.stepped:
            log.warning(
                "reward-model update skipped at step %d: loss %s, grad norm %s",
                self.global_step, update.global_loss, update.grad_norm,
            )  # fmt: skip
        metrics = sums.reduce(self.device)
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        metrics["train/grad_norm"] = update.grad_norm if update.stepped else float("nan")
        metrics["train/skipped_nonfinite"] = 0.0 if update.stepped else 1.0
        elapsed = time.perf_counter() - started
        metrics["timing_s/step"] = elapsed
        metrics["perf/tokens"] = float(pairs.num_tokens)
        metrics["perf/tokens_per_s"] = pairs.num_tokens / elapsed if elapsed > 0 else 0.0
        metrics["perf/peak_memory_gb"] = peak_memory_gb(self.device.type, self._rss_before_models_kb)  # fmt: skip
        self.global_step += 1
        return metrics

    @torch.no_grad()
    def score(self, batch: pa.RecordBatch | None) -> tuple[np.ndarray, np.ndarray]:
        """Collective: (chosen scores [B], rejected scores [B]) of rank 0's pairs, on every rank."""
        pairs = self._pairs(batch)
        flat = torch.zeros(2 * pairs.size, dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            for indices in self._plan(pairs):
                mb = self._inputs(pairs, indices)
                chosen, rejected = split_scores(value_forward(self.model, mb)[0], mb)
                if len(indices):
                    where = torch.from_numpy(indices).to(self.device)
                    flat[where] = chosen.double()
                    flat[where + pairs.size] = rejected.double()
        finally:
            self.model.train()
        flat = ldist.all_reduce_sum(flat).cpu().numpy()
        return flat[: pairs.size], flat[pairs.size :]

    # ------------------------------------------------------------------ weights out

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: (Hugging Face name, full tensor), one at a time (LoRA: merged)."""
        return weights_out.named_full_tensors(self.model, lora_on=self.uses_lora)

    # ------------------------------------------------------------------ checkpoints

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer, options=frozen_base_options(self.uses_lora)
        )
        return {"reward_model": model_sd, "reward_model_optim": optim_sd}

    def save_checkpoint(self, root: str | Path, extra_state: dict[str, Any]) -> Path:
        """Collective: write ``<root>/step_<global_step>`` atomically (``learner.checkpoint``)."""
        meta = {
            "kind": "reward_model",
            "scheduler": scheduler_state(self.scheduler),
            "extra_state": extra_state,
            "adapter_config": lora.adapter_config(self.model) if self.uses_lora else None,
        }
        return ckpt.write_checkpoint(
            root, self.global_step, self._dcp_state(), meta, self.model_cfg.path
        )

    def load_checkpoint(self, step_dir: str | Path) -> dict[str, Any]:
        """Collective: restore model, optimizer, schedule, RNG and step; returns extra_state."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if ckpt.read_meta(step_dir).get("kind") != "reward_model":
            raise ckpt.CheckpointError(
                f"checkpoint {step_dir} is not a reward-model checkpoint (an RL run's?)"
            )
        state = self._dcp_state()
        meta = ckpt.read_checkpoint(step_dir, state)
        set_state_dict(
            self.model, self.optimizer,
            model_state_dict=state["reward_model"], optim_state_dict=state["reward_model_optim"],
            options=frozen_base_options(self.uses_lora),
        )  # fmt: skip
        self.scheduler.load_state_dict(meta["scheduler"])
        self.global_step = int(meta["step"])
        log.info("rank %d resumed from %s (step %d)", self.rank, step_dir, self.global_step)
        return meta["extra_state"]
