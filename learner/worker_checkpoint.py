"""A LearnerWorker's checkpoint: which of its state goes where, and how it comes back.

``learner.checkpoint`` owns the folder (layout, atomic write, discovery, RNG);
this module owns what a worker puts in it and restores from it:

- DCP shards: the policy and its optimizer, and with a critic the critic and
  its optimizer, as ``torch.distributed.checkpoint.state_dict`` gives them
  (sharded: any world size can load them). A LoRA policy saves its adapters
  only: the frozen base is not checkpointed, it is re-read from the model
  folder at ``setup``.
- meta.json: step, policy version, the LR schedulers (JSON: the lambdas are
  rebuilt from config), the KL controller, the caller's ``extra_state`` (data
  cursor, ...), and for LoRA the ``adapter_config`` that ``learner.export``
  rebuilds the peft model from.

Both functions are collectives: every rank of the learner group calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fleetrl.log import get_logger
from learner import checkpoint as ckpt
from learner.optimizer_offload import states_on_device

if TYPE_CHECKING:
    from learner.worker import LearnerWorker

log = get_logger(__name__)


def save(worker: LearnerWorker, root: str | Path, extra_state: dict[str, Any]) -> Path:
    """Write ``<root>/step_<global_step>`` atomically; returns its path."""
    meta = {
        "policy_version": worker.policy_version,
        "scheduler": scheduler_state(worker.scheduler),
        "critic_scheduler": scheduler_state(worker.critic_scheduler) if worker.critic else None,
        "kl_ctrl": worker.kl_ctrl.state_dict(),
        "extra_state": extra_state,
        # LoRA: the policy in the checkpoint is a peft model; export rebuilds it from this
        "adapter_config": worker.adapter_config() if worker.uses_lora else None,
    }
    with states_on_device(list(worker.offloaded.values())):  # saved as without offload
        return ckpt.write_checkpoint(
            root, worker.global_step, _dcp_state(worker), meta, worker.model_cfg.path
        )


def load(worker: LearnerWorker, step_dir: str | Path) -> dict[str, Any]:
    """Restore models, optimizers, schedulers, RNG, step and version; returns extra_state."""
    pairs = [(worker.policy, worker.optimizer, "policy", frozen_base_options(worker.uses_lora))]
    if worker.critic is not None:
        pairs.append((worker.critic, worker.critic_optimizer, "critic", None))
    meta = restore(step_dir, lambda: _dcp_state(worker), pairs, list(worker.offloaded.values()))
    if worker.critic is not None:
        worker.critic_scheduler.load_state_dict(meta["critic_scheduler"])
    worker.scheduler.load_state_dict(meta["scheduler"])
    worker.kl_ctrl.load_state_dict(meta["kl_ctrl"])
    worker.global_step = int(meta["step"])
    worker.policy_version = int(meta["policy_version"])
    log.info("rank %d resumed from %s (step %d)", worker.rank, step_dir, worker.global_step)
    return meta["extra_state"]


def restore(
    step_dir: str | Path,
    make_state: Callable[[], dict[str, Any]],
    pairs: list[tuple[Any, Any, str, Any]],
    offloaded: list[Any],
) -> dict[str, Any]:
    """Read ``step_dir`` into ``make_state()``'s dict and set each (model, optimizer, key,
    options) from its ``key`` and ``key_optim`` entries; the checkpoint's meta. Offloaded
    optimizer state (``learner.optimizer_offload``) is loaded on the device, then goes
    back to the host. Used by the RL and the reward-model learners."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    with states_on_device(offloaded):
        state = make_state()
        meta = ckpt.read_checkpoint(step_dir, state)
        for model, optimizer, key, options in pairs:
            set_state_dict(
                model, optimizer, model_state_dict=state[key],
                optim_state_dict=state[f"{key}_optim"], options=options,
            )  # fmt: skip
    return meta


def frozen_base_options(uses_lora: bool):
    """LoRA: the frozen base is not checkpointed (it is re-read from the model folder)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=uses_lora, strict=not uses_lora)


def _dcp_state(worker: LearnerWorker) -> dict[str, Any]:
    """The DCP-stateful dict of the worker's models and optimizers (what the shards hold)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    policy_sd, optim_sd = get_state_dict(
        worker.policy, worker.optimizer, options=frozen_base_options(worker.uses_lora)
    )
    state = {"policy": policy_sd, "policy_optim": optim_sd}
    if worker.critic is not None:
        critic_sd, critic_optim_sd = get_state_dict(worker.critic, worker.critic_optimizer)
        state.update(critic=critic_sd, critic_optim=critic_optim_sd)
    return state


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """A LambdaLR state as JSON (the lambdas themselves are rebuilt from config)."""
    state = scheduler.state_dict()
    state["lr_lambdas"] = [None] * len(state.get("lr_lambdas", []))
    return state
