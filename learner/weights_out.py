"""The trained policy's full weights as an engine loads them: the checkpoint's names, full tensors.

``named_full_tensors`` is the source of the full weight sync
(``weight_sync.sender``) and of ``LearnerWorker.named_full_tensors``: it walks
the FSDP2-sharded policy and all-gathers one parameter at a time
(``DTensor.full_tensor``), so no rank ever holds the whole model at once. It is
a collective: every rank iterates it to the end; rank 0 uses the tensors.

With LoRA the engines get the base model's Hugging Face names, each weight
with its adapter merged in (``learner.lora.merged_weight``: what the trained
policy computes), and no adapter tensors. The adapter-only stream of the LoRA
sync is ``learner.lora.named_adapter_tensors``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fleetrl.models.checkpoint_names import CheckpointNames
from learner import lora


def named_full_tensors(policy: nn.Module, *, lora_on: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: yields (HF parameter name, full tensor) one at a time.

    Order is ``policy.state_dict()`` order; tied parameters appear once (under
    the name ``named_parameters()`` gives them); persistent buffers are included. Names
    are the files' (``fleetrl.models.checkpoint_names``: GPT-NeoX's ``embed_out.weight``).
    ``lora_on``: the policy is a peft model; its adapters are merged into their base weights.
    """
    wanted = {name for name, _ in policy.named_parameters()}
    wanted |= {name for name, _ in policy.named_buffers()}
    files = CheckpointNames.of(policy)
    seen: set[str] = set()
    for name, tensor in policy.state_dict().items():
        if name not in wanted or name in seen:
            continue
        seen.add(name)
        if lora_on and lora.is_adapter(name):
            continue  # folded into its base weight below
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if lora_on:
            merged = lora.merged_weight(policy, name, full.detach())
            yield files.to_file(lora.checkpoint_name(name)), merged
        else:
            yield files.to_file(name), full.detach()
