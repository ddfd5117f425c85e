"""LearnerWorker: one rank of the FSDP2 learner group (policy, optional reference and critic).

The class is free of Ray: tests drive it through ``torch.multiprocessing``, the
launcher wraps it in a Ray actor, ``train_iter`` runs it standalone on any
iterable of Arrow batches (the "iterator seam": no buffer needed).

    worker = LearnerWorker(learner_cfg, model_cfg, rank=r, world_size=w,
                           master_addr="127.0.0.1", master_port=port, seed=1)
    worker.setup()                                  # group, models, optimizers
    metrics = worker.step(batch_or_None, policy_version)   # every rank, collectively
    for name, tensor in worker.named_full_tensors(): ...   # every rank; rank 0 uses them
    for name, tensor in worker.named_adapter_tensors(): ...  # LoRA: adapters only, peft names
    worker.save_checkpoint(root, extra_state) / worker.load_checkpoint(step_dir)
    worker.close()

One ``step`` (every rank runs the same code on the same global batch):

    rank 0's Arrow batch --broadcast IPC bytes--> every rank: GlobalBatch
      -> π_prox (unless bypass), π_ref (if any KL), V(s) (if gae): no-grad forwards over this
         rank's share, all-reduced into global per-token tensors
      -> prepare_targets: rewards (+KL), advantages, IS weights over the global batch
      -> for epoch, for mini-batch (whole groups): micro-batches of this rank's share;
         loss = policy_loss (PPO clip or GSPO: policy_loss.loss_mode)(global counts, dp_size)
                − c_H·H + c_KL·KL; backward (summed)
         -> clip grad norm; optimizer step unless loss or norm is non-finite
         -> critic: the same with value_loss
      -> LR schedulers step once; metrics reduced over ranks (token-weighted)

Metric names follow verl (``actor/pg_loss``, ``critic/vf_loss``, ``timing_s/old_log_prob``,
``timing_s/ref``, ``timing_s/values``, ``timing_s/adv``, ``timing_s/update_actor``,
``timing_s/update_critic``, ...), plus ``staleness/*``, ``is/*``, ``response/*``; ``actor/skipped_nonfinite``
counts mini-batches whose update was skipped (the driver stops after too many in a row).
Losses and per-token metrics count trained tokens only (``batching.response_mask``).

Models are built on the meta device and each rank reads only its shards
(``learner.model_build`` over ``learner.sharded_load``). With
``sequence_parallel`` k, groups of k ranks split each packed micro-batch along
the sequence (``learner.ulysses``); data parallelism is over the groups.

This module is the step; beside it live the weights the engines load
(``learner.weights_out``, ``learner.lora``) and what a checkpoint holds and how
it comes back (``learner.worker_checkpoint``, over ``learner.checkpoint``'s folder).

With ``learner.lora.rank`` > 0 the policy is wrapped by peft (``learner.lora``):
only its adapters train, the reference logprobs come from the same model with
its adapters off (no reference copy is built), and ``named_adapter_tensors`` /
``adapter_config`` give what an engine needs to load the adapters.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
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
from learner import algorithms as alg
from learner import dist as ldist
from learner import lora, proximal, ulysses, weights_out, worker_checkpoint
from learner.batching import GlobalBatch, global_counts, mini_batches, plan_ranks
from learner.config import LearnerConfig
from learner.fsdp import build_optimizer, build_scheduler, guarded_step
from learner.memory import peak_memory_gb, rss_kb
from learner.model_build import build_model, init_value_head, stored_head
from learner.optimizer_offload import OffloadedOptimizer, offload_optimizers
from learner.packing import (
    MicroBatchInputs,
    build_inputs,
    build_shared_inputs,
    layout_cost,
    packed_row_budget,
    packing_allowed,
    padding_is_cheaper,
    policy_forward,
    split_by_sequence,
    value_forward,
)
from learner.prepare import (
    Targets,
    batch_metrics,
    make_kl_controller,
    prepare_targets,
    ragged_to_padded,
)
from learner.sharded_load import ModelKind
from learner.shared_prompt import distinct_prompts, prompts_shareable, shared_cost
from learner.step_timer import StepTimer
from learner.ulysses import SPGroup
from learner.value_model import check_critic_vocabulary

log = get_logger(__name__)


class LearnerWorker:
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
        max_response_length: int = 0,
    ) -> None:
        if learner_cfg.algorithm.overlong_buffer_len and max_response_length <= 0:
            raise ValueError(
                "learner.algorithm.overlong_buffer_len needs the response cap: pass"
                " max_response_length (rollout.max_new_tokens)"
            )
        if "seq-mean-token-sum-norm" in (
            learner_cfg.policy_loss.loss_agg_mode,
            learner_cfg.critic.loss_agg_mode,
        ) and not (learner_cfg.policy_loss.loss_scale_factor or max_response_length > 0):
            raise ValueError(
                "loss_agg_mode seq-mean-token-sum-norm needs its constant: set"
                " learner.policy_loss.loss_scale_factor or pass max_response_length"
            )
        self.cfg = learner_cfg
        self.max_response_length = max_response_length
        # seq-mean-token-sum-norm's constant: the same for every micro-batch of every step
        self.policy_loss_scale = float(
            learner_cfg.policy_loss.loss_scale_factor or max_response_length or 1
        )
        self.value_loss_scale = float(max_response_length or self.policy_loss_scale)
        self.model_cfg = model_cfg
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.seed = seed
        self.device = torch.device(device)
        self.total_steps = total_steps
        self.global_step = 0
        self.policy_version = 0
        self.policy: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.critic: nn.Module | None = None
        # learner.optimizer_offload: optimizer state on the host between steps, by optimizer
        self.offloaded: dict[int, OffloadedOptimizer] = {}
        self.kl_ctrl = make_kl_controller(learner_cfg)
        self._proximal: proximal.FromUpdate | None = None  # this step's, when it has one
        # Ulysses: ranks [g·k, (g+1)·k) form SP group g and share its micro-batches
        self.sp: SPGroup | None = None
        self.sp_size = learner_cfg.sequence_parallel
        self.dp_rank, self.dp_size = rank // self.sp_size, world_size // self.sp_size
        self.sp_leader = rank % self.sp_size == 0
        # metric weight: the group's leader reports for it (every rank adds every key,
        # so that the metric all-reduce stays collective)
        self._report = 1.0 if self.sp_leader else 0.0

    # ------------------------------------------------------------------ setup

    @property
    def uses_critic(self) -> bool:
        mode = self.cfg.critic.enabled
        return mode == "on" or (mode == "auto" and self.cfg.algorithm.adv_estimator == "gae")

    @property
    def uses_reference(self) -> bool:
        return self.cfg.kl.use_kl_in_reward or self.cfg.kl.use_kl_loss

    @property
    def uses_lora(self) -> bool:
        return self.cfg.lora.rank > 0

    def setup(self) -> None:
        """Join the group, then load, shard and build optimizers for every model."""
        if self.cfg.algorithm.adv_estimator == "gae" and not self.uses_critic:
            raise ValueError("learner.algorithm.adv_estimator=gae needs learner.critic.enabled")
        pl = self.cfg.policy_loss
        if self.rank == 0 and pl.loss_mode == "gspo" and pl.loss_agg_mode != alg.GSPO_AGG_MODE:
            log.info(
                "learner.policy_loss.loss_mode=gspo aggregates the policy loss %s (as verl); "
                "learner.policy_loss.loss_agg_mode=%s reduces only the entropy bonus and KL loss",
                alg.GSPO_AGG_MODE, pl.loss_agg_mode,
            )  # fmt: skip
        if self.uses_critic and self.cfg.critic.model_path:  # checked before the group forms
            check_critic_vocabulary(
                check_model_dir(self.model_cfg.path), check_model_dir(self.cfg.critic.model_path)
            )
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        ldist.init_group(
            master_addr=self.master_addr,
            master_port=self.master_port,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            timeout_s=self.cfg.distributed_timeout_s,
        )
        torch.manual_seed(self.seed)
        np.random.seed(self.seed % 2**32)
        self._rss_before_models_kb = rss_kb()  # CPU peak memory counts from here
        path = check_model_dir(self.model_cfg.path)
        on_gpu = self.device.type == "cuda"
        self.bf16 = self.cfg.mixed_precision == "bf16" or (
            self.cfg.mixed_precision == "auto" and on_gpu
        )
        offload = self.cfg.param_offload and on_gpu
        if self.sp_size > 1:
            self.sp = ulysses.new_groups(self.world_size, self.rank, self.sp_size)
        self.policy = self._build(path, "causal_lm", offload, train=True, lora_on=self.uses_lora)
        self.policy_dropout = proximal.has_active_dropout(self.policy)
        # what decides how many rows a packed micro-batch takes (packing.packed_row_budget)
        self.attn_implementation = getattr(self.policy.config, "_attn_implementation", None)
        self.packing = packing_allowed(
            self.policy.config, self.cfg.packing, self.sp_size, rank=self.rank
        )
        self.hidden_size = model_sizes(self.policy.config).hidden  # padding_is_cheaper's cost
        self.share_prompts = prompts_shareable(
            self.policy.config, self.cfg.share_prompts, sp_size=self.sp_size, rank=self.rank,
            checkpointing=self.cfg.grad_checkpointing or self.model_cfg.gradient_checkpointing,
        )  # fmt: skip
        self.optimizer = build_optimizer(self.policy.parameters(), self.cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, self.total_steps)
        if self.uses_reference and not self.uses_lora:  # LoRA: the base is the reference
            self.reference = self._build(
                path, "causal_lm", self.cfg.reference.param_offload and on_gpu, train=False
            ).requires_grad_(False)
        if self.uses_critic:
            critic_path = self._critic_path(path)
            self.critic = self._build(critic_path, "token_classification", offload, train=True)
            init_value_head(
                self.critic, self.seed, self.cfg.critic.value_head_init_std,
                keep=stored_head(critic_path),  # a reward model's head is the value head
            )  # fmt: skip
            self.critic_optimizer = build_optimizer(self.critic.parameters(), self.cfg.critic.optim)
            self.critic_scheduler = build_scheduler(
                self.critic_optimizer, self.cfg.critic.optim, self.total_steps
            )
        optimizers = [self.optimizer, getattr(self, "critic_optimizer", None)]
        self.offloaded = offload_optimizers(optimizers, self.device, self.cfg)

    def _critic_path(self, policy_path: Path) -> Path:
        """The folder the critic is built from: ``critic.model_path`` (its vocabulary checked
        before the group formed), ``critic.init_from``'s reward model (checked: a one-label
        classifier over the policy's vocabulary), or the policy's."""
        source = self.cfg.critic.init_from
        if not source:
            return Path(self.cfg.critic.model_path) if self.cfg.critic.model_path else policy_path
        from fleetrl.models.reward_folder import check_reward_folder

        reward_config = check_reward_folder(check_model_dir(source))
        policy_vocab = self.policy.config.vocab_size
        if reward_config.get("vocab_size") != policy_vocab:
            raise ValueError(
                f"learner.critic.init_from={source}: its vocab_size "
                f"{reward_config.get('vocab_size')} is not the policy's {policy_vocab} (the "
                "critic reads the policy's tokens)"
            )
        return Path(source)

    def _build(
        self, path: Path, kind: ModelKind, offload: bool, *, train: bool, lora_on: bool = False
    ) -> nn.Module:
        """One model on this rank (``learner.model_build``); ``lora_on``: wrapped by peft."""
        return build_model(
            path, kind, device=self.device, train=train,
            grad_checkpointing=self.cfg.grad_checkpointing or self.model_cfg.gradient_checkpointing,
            bf16=self.bf16, offload=offload, reshard_after_forward=self.cfg.reshard_after_forward,
            lora_cfg=self.cfg.lora if lora_on else None, seed=self.seed, sp_size=self.sp_size,
        )  # fmt: skip

    def close(self) -> None:
        ldist.close_group()

    # ------------------------------------------------------------------ the step

    def _plan(self, batch: GlobalBatch, indices: np.ndarray) -> list[np.ndarray]:
        plans = plan_ranks(
            indices,
            batch.seq_lens,
            self.dp_size,
            use_dynamic_bsz=self.cfg.use_dynamic_bsz,
            max_tokens=self.cfg.max_tokens_per_micro_batch * self.sp_size,
            micro_batch_size=self.cfg.micro_batch_size,
            packing=self.packing,
        )
        return plans[self.dp_rank]

    def _inputs(
        self, batch: GlobalBatch, indices: np.ndarray, *, policy: bool = True
    ) -> MicroBatchInputs:
        """A micro-batch's inputs in the layout that computes least: packed or padded, or
        (the policy's forward, ``learner.share_prompts``) its distinct prompts once."""
        packing, lens = self.packing, batch.seq_lens[indices]
        row_tokens = (
            packed_row_budget(
                self.attn_implementation, self.cfg.packed_row_tokens, lens, self.sp_size
            )
            if packing
            else None
        )
        if row_tokens is not None and not self.cfg.packed_row_tokens:  # the automatic budget
            packing = not padding_is_cheaper(lens, row_tokens, self.hidden_size)
        if policy and self.share_prompts:
            prompts = distinct_prompts(batch, indices)
            if self._shares(batch, indices, prompts[0], packing, row_tokens):
                return build_shared_inputs(batch, indices, self.device, prompts)
        return build_inputs(
            batch, indices, packing=packing, device=self.device, row_tokens=row_tokens
        )

    def _shares(
        self,
        batch: GlobalBatch,
        indices: np.ndarray,
        prompts: list[np.ndarray],
        packing: bool,
        row_tokens: int | None,
    ) -> bool:
        """Whether the policy's forward over ``indices`` (whose distinct ``prompts`` these
        are) runs them once: on more than one rank always (every rank must call the FSDP
        model as often, an empty micro-batch included), on one where it computes less
        (``shared_cost``)."""
        if self.world_size > 1:
            return True
        if len(indices) < 2:
            return False
        shared = shared_cost(
            np.array([len(p) for p in prompts]), batch.response_lens[indices], self.hidden_size
        )
        lens = batch.seq_lens[indices]
        return shared < layout_cost(
            lens, packing=packing, budget=row_tokens, hidden=self.hidden_size
        )

    @torch.no_grad()
    def _infer(self, model: nn.Module, batch: GlobalBatch, plan: list[np.ndarray], values: bool):
        """Per-token logprobs (or values) of the whole batch: this rank's share, all-reduced."""
        flat = torch.zeros(int(batch.response_lens.sum()), device=self.device)
        model.eval()
        for indices in plan:
            mb = self._inputs(batch, indices, policy=not values)
            out = (
                value_forward(model, mb, sp=self.sp)[0]
                if values
                else policy_forward(model, mb, sp=self.sp).logprobs
            )
            if mb.num_tokens and self.sp_leader:  # the group's ranks all hold the same values
                positions = np.concatenate(
                    [np.arange(batch.response_offsets[i], batch.response_offsets[i + 1])
                     for i in indices]
                )  # fmt: skip
                flat[torch.from_numpy(positions).to(self.device)] = out.float()
        model.train(model is not self.reference)
        return ragged_to_padded(ldist.all_reduce_sum(flat), batch)

    def _reference_logprobs(self, batch: GlobalBatch, plan: list[np.ndarray]):
        """π_ref per token: the reference model, or (LoRA) the policy with its adapters off."""
        if self.reference is not None:
            return self._infer(self.reference, batch, plan, values=False)
        if self.uses_reference and self.uses_lora:
            with lora.reference_mode(self.policy):
                return self._infer(self.policy, batch, plan, values=False)
        return None

    def step(self, batch: pa.RecordBatch | None, policy_version: int) -> dict[str, float]:
        """One training step on a global batch (rank 0 passes it, other ranks None)."""
        if self.policy is None:
            raise RuntimeError("LearnerWorker.step called before setup()")
        started = time.perf_counter()
        gb = GlobalBatch.from_arrow(
            ldist.broadcast_record_batch(
                batch, rank=self.rank, world_size=self.world_size, device=self.device
            )
        )
        everything = np.arange(gb.size)
        infer_plan = self._plan(gb, everything)
        metrics = batch_metrics(gb, policy_version)

        # verl's timing names: old_log_prob (π_prox), ref, values, adv, update_actor/critic
        timer = StepTimer(metrics)
        # critic warm-up (learner.critic.warmup_steps): the policy waits for useful values
        train_policy = self.global_step >= self.cfg.critic.warmup_steps
        minis = mini_batches(gb.group_index, self.cfg.ppo_mini_batch_size)
        from_update = proximal.from_update(
            self.cfg, len(minis), train_policy=train_policy, policy_dropout=self.policy_dropout
        )
        prox = None
        if self.cfg.correction.mode != "bypass" and not from_update:
            with timer("old_log_prob"):
                prox = self._infer(self.policy, gb, infer_plan, values=False)
        ref = None
        if self.uses_reference:
            with timer("ref"):
                ref = self._reference_logprobs(gb, infer_plan)
        values = None
        if self.critic is not None:
            with timer("values"):
                values = self._infer(self.critic, gb, infer_plan, True)
        with timer("adv"):
            targets, target_metrics = prepare_targets(
                gb, self.cfg, prox_logprob=prox, ref_logprob=ref, values=values,
                kl_ctrl=self.kl_ctrl, device=self.device,
                max_response_length=self.max_response_length, proximal_from_update=from_update,
            )  # fmt: skip
        metrics.update(target_metrics)
        self._proximal = proximal.FromUpdate(gb, self.cfg, self.device) if from_update else None

        sums = ldist.MetricSums()
        self._update_stats: dict[str, list[float]] = defaultdict(list)
        for _epoch in range(self.cfg.ppo_epochs):
            for mini in minis:
                plan = self._plan(gb, mini)
                counts = global_counts(gb, mini)
                if train_policy:
                    with timer("update_actor"):
                        self._update_policy(gb, plan, targets, counts, sums)
                if self.critic is not None:
                    with timer("update_critic"):
                        self._update_critic(gb, plan, targets, counts, sums)
        if self._proximal is not None:
            metrics.update(self._proximal.metrics(targets.behavior, targets.mask))
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        if train_policy:
            self.scheduler.step()
        if self.critic is not None:
            metrics["critic/lr"] = self.critic_scheduler.get_last_lr()[0]
            self.critic_scheduler.step()
        metrics.update(sums.reduce(self.device))
        roles = ("actor",) if train_policy else ()
        for role in roles + (("critic",) if self.critic is not None else ()):
            norms = self._update_stats[f"{role}/grad_norm"]
            metrics[f"{role}/grad_norm"] = float(np.mean(norms)) if norms else float("nan")
            metrics[f"{role}/skipped_nonfinite"] = float(
                len(self._update_stats[f"{role}/skipped_nonfinite"])
            )
        if train_policy and self.cfg.kl.use_kl_loss:
            metrics["actor/kl_coef"] = self.cfg.kl.kl_loss_coef
        metrics["timing_s/step"] = time.perf_counter() - started
        metrics["perf/peak_memory_gb"] = peak_memory_gb(
            self.device.type, self._rss_before_models_kb
        )
        self.global_step += 1
        self.policy_version = policy_version
        return metrics

    def _update_policy(
        self,
        batch: GlobalBatch,
        plan: list[np.ndarray],
        targets: Targets,
        counts: tuple[int, int],
        sums: ldist.MetricSums,
    ) -> None:
        pl, ws = self.cfg.policy_loss, self.world_size
        count_kwargs = dict(
            global_token_count=counts[0], global_seq_count=counts[1], dp_size=ws,
            loss_scale_factor=self.policy_loss_scale,
        )  # fmt: skip
        pg_loss_local = torch.zeros((), dtype=torch.float64, device=self.device)
        kl_loss_local = torch.zeros((), dtype=torch.float64, device=self.device)
        for indices in plan:
            mb = self._inputs(batch, indices)
            out = policy_forward(
                self.policy, mb, entropy="grad" if pl.entropy_coeff > 0 else "metric", sp=self.sp
            )
            logprob = split_by_sequence(out.logprobs, mb)
            width = logprob.shape[1]
            mask = targets.mask[indices, :width]
            pick = _slicer(indices, width)
            old_logprob, is_weights = pick(targets.old_logprob), pick(targets.is_weights)
            if self._proximal is not None:  # π_prox is this forward's (learner.proximal)
                old_logprob, is_weights = self._proximal.micro_batch(
                    logprob, out.logprobs, pick(targets.behavior), mask, indices,
                    record=bool(mb.num_tokens) and self.sp_leader,
                )  # fmt: skip
            loss_inputs = (logprob, old_logprob, pick(targets.advantages), mask)
            clip_kwargs = dict(
                clip_ratio_low=pl.clip_ratio_low, clip_ratio_high=pl.clip_ratio_high,
                clip_ratio_c=pl.clip_ratio_c, is_weights=is_weights,
                behavior_logprob=pick(targets.behavior_logprob),
            )  # fmt: skip
            if pl.loss_mode == "gspo":  # always seq-mean-token-mean (learner.gspo)
                loss, m = alg.gspo_policy_loss(
                    *loss_inputs, **clip_kwargs, global_seq_count=counts[1], dp_size=ws
                )
                seqs = float((mask > 0).any(dim=-1).sum()) * self._report
                for key in ("seq_ratio_mean", "seq_ratio_abs_dev"):
                    sums.add(f"actor/{key}", float(m[key]), seqs)
            else:
                loss, m = alg.policy_loss(
                    *loss_inputs, **clip_kwargs, loss_agg_mode=pl.loss_agg_mode, **count_kwargs
                )
            pg_loss_local += m["pg_loss"]
            entropy = split_by_sequence(out.entropy, mb)
            if pl.entropy_coeff > 0:
                loss = loss - pl.entropy_coeff * alg.agg_loss(
                    entropy, mask, pl.loss_agg_mode, **count_kwargs
                )
            if self.cfg.kl.use_kl_loss:
                kl = alg.kl_loss(
                    logprob, pick(targets.ref_logprob), mask, self.cfg.kl.kl_kind,
                    pl.loss_agg_mode, **count_kwargs,
                )  # fmt: skip
                loss = loss + self.cfg.kl.kl_loss_coef * kl
                kl_loss_local += kl.detach()
            (loss + out.anchor).backward()
            tokens = float(mask.sum()) * self._report  # trained tokens: metrics are over them
            sums.add("actor/entropy", float(alg.masked_mean(entropy.detach(), mask)), tokens)
            sums.add("actor/pg_clipfrac", float(m["pg_clipfrac"]), tokens)
            sums.add("actor/pg_clipfrac_lower", float(m["pg_clipfrac_lower"]), tokens)
            sums.add("actor/pg_clipfrac_behavior", float(m["pg_clipfrac_behavior"]), tokens)
            sums.add("actor/ppo_kl", float(m["ppo_kl"]), tokens)
        # Each micro-batch loss is (its share of the global mean) × ws: summing over
        # micro-batches and ranks and dividing by ws gives this mini-batch's global loss.
        # Weight 1/ws per rank makes the reduced value the mean over mini-batches.
        # Under SP only group leaders report, each for its k ranks (hence ÷ k).
        report = self._report / ws
        sums.add("actor/pg_loss", float(pg_loss_local) / self.sp_size, report)
        if self.cfg.kl.use_kl_loss:
            sums.add("actor/kl_loss", float(kl_loss_local) / self.sp_size, report)
        self._optimizer_step(
            "actor", self.policy, self.optimizer, self.cfg.optim.grad_clip, pg_loss_local
        )

    def _update_critic(
        self,
        batch: GlobalBatch,
        plan: list[np.ndarray],
        targets: Targets,
        counts: tuple[int, int],
        sums: ldist.MetricSums,
    ) -> None:
        ws, cc = self.world_size, self.cfg.critic
        vf_loss_local = torch.zeros((), dtype=torch.float64, device=self.device)
        for indices in plan:
            mb = self._inputs(batch, indices, policy=False)
            flat_values, anchor = value_forward(self.critic, mb, sp=self.sp)
            values = split_by_sequence(flat_values, mb)
            width = values.shape[1]
            mask = targets.mask[indices, :width]
            loss, m = alg.value_loss(
                values, targets.old_values[indices, :width], targets.returns[indices, :width],
                mask, cc.cliprange_value, cc.loss_agg_mode, counts[0], counts[1], dp_size=ws,
                loss_scale_factor=self.value_loss_scale,
            )  # fmt: skip
            (loss + anchor).backward()
            vf_loss_local += loss.detach()
            tokens = float(mask.sum()) * self._report  # trained tokens: metrics are over them
            sums.add("critic/vf_clipfrac", float(m["vf_clipfrac"]), tokens)
        sums.add("critic/vf_loss", float(vf_loss_local) / self.sp_size, self._report / ws)
        self._optimizer_step(
            "critic", self.critic, self.critic_optimizer, cc.optim.grad_clip, vf_loss_local
        )

    def _optimizer_step(
        self,
        role: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        local_loss: torch.Tensor,
    ) -> None:
        """Clip and step, or skip (and count) when the loss or the gradient norm is not finite.

        The global loss and the gradient norm are the same on every rank, so every
        rank takes the same decision.
        """
        stepper = self.offloaded.get(id(optimizer), optimizer)  # its state streamed, if offloaded
        update = guarded_step(model, stepper, max_norm, local_loss)
        if update.stepped:
            self._update_stats[f"{role}/grad_norm"].append(update.grad_norm)
        else:
            self._update_stats[f"{role}/skipped_nonfinite"].append(1.0)
            log.warning(
                "%s update skipped at step %d: loss %s, grad norm %s",
                role, self.global_step, update.global_loss, update.grad_norm,
            )  # fmt: skip

    # ------------------------------------------------------------------ weights out

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every rank iterates; yields (HF parameter name, full tensor) one at a time.

        With LoRA: each base weight with its adapter merged in, no adapter tensors
        (``learner.weights_out``).
        """
        return weights_out.named_full_tensors(self.policy, lora_on=self.uses_lora)

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective (LoRA only): every rank iterates; yields (peft saved name, full CPU tensor).

        The names are the keys of ``peft.get_peft_model_state_dict`` (those
        ``save_pretrained`` writes to ``adapter_model.safetensors``, e.g.
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); every
        rank gets the values.
        """
        self._require_lora("named_adapter_tensors")
        return lora.named_adapter_tensors(self.policy)

    def adapter_config(self) -> dict[str, Any]:
        """The adapter's ``adapter_config.json`` contents (LoRA only; JSON types)."""
        self._require_lora("adapter_config")
        return lora.adapter_config(self.policy)

    def _require_lora(self, what: str) -> None:
        if not self.uses_lora:
            raise RuntimeError(
                f"LearnerWorker.{what} needs LoRA: learner.lora.rank is 0 (full training); "
                "use named_full_tensors for the whole model"
            )
        if self.policy is None:
            raise RuntimeError(f"LearnerWorker.{what} called before setup()")

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, root: str | Path, extra_state: dict[str, Any]) -> Path:
        """Collective: write ``<root>/step_<global_step>`` atomically; returns its path."""
        return worker_checkpoint.save(self, root, extra_state)

    def load_checkpoint(self, step_dir: str | Path) -> dict[str, Any]:
        """Collective: restore models, optimizers, schedulers, RNG, step; returns extra_state."""
        return worker_checkpoint.load(self, step_dir)

    # ------------------------------------------------------------------ standalone

    def train_iter(self, batches: Iterable[pa.RecordBatch | None]) -> Iterator[dict[str, float]]:
        """Train on each batch in turn (rank 0's iterable holds batches, others Nones)."""
        for batch in batches:
            yield self.step(batch, policy_version=self.global_step)


def _slicer(indices: np.ndarray, width: int):
    """Rows ``indices``, first ``width`` columns of a global ``[B, T]`` target (None passes)."""
    return lambda t: None if t is None else t[indices, :width]
