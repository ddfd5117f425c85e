"""``fleetrl export --ckpt DIR --out DIR``: a Hugging Face model folder from a learner checkpoint.

Single process, no process group: the policy's sharded weights are read from the
DCP checkpoint with ``dcp.load(..., no_dist=True)`` straight into a model built
from the checkpoint's own ``hf/config.json`` (materialised empty, then filled),
saved as safetensors in the config's dtype, with the tokenizer files copied
from the checkpoint's ``hf/`` folder (written there from the original model path
at save time, so the export does not depend on that path still existing).

``--ckpt`` may be one ``step_<N>`` folder or a checkpoint root, in which case
the latest complete checkpoint is used.

Left out: exporting the critic, merging LoRA adapters.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger
from learner.checkpoint import (
    COMPLETE_MARKER,
    HF_DIR,
    TOKENIZER_FILES,
    CheckpointError,
    latest_complete_checkpoint,
    read_meta,
)

log = get_logger(__name__)

_POLICY_PREFIX = "policy."


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if (path / COMPLETE_MARKER).exists() or path.name.startswith("step_"):
        read_meta(path)  # raises CheckpointError naming what is wrong
        return path
    found = latest_complete_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint under {path}")
    return found


def load_policy(ckpt: str | Path) -> tuple[Any, Path]:
    """The policy of checkpoint ``ckpt`` as a CPU Hugging Face model in its config's dtype,
    and the step folder it came from (a bad checkpoint raises CheckpointError)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForCausalLM

    step_dir = resolve_checkpoint(ckpt)
    hf = step_dir / HF_DIR
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"checkpoint {step_dir} has no {HF_DIR}/config.json")
    config = AutoConfig.from_pretrained(str(hf), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    stored = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    target = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if _POLICY_PREFIX + name in stored
    }
    missing = {n for n, _ in model.named_parameters()} - set(target)
    if missing:
        raise CheckpointError(
            f"checkpoint {step_dir} lacks policy weights {sorted(missing)[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    dcp.load(
        {_POLICY_PREFIX + name: tensor for name, tensor in target.items()},
        checkpoint_id=str(step_dir),
        no_dist=True,
    )
    model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) stay uninitialised here: save_pretrained does
    # not write them, and from_pretrained recomputes them.
    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return model.to(dtype), step_dir


def export_checkpoint(ckpt: str | Path, out: str | Path) -> Path:
    """Write the policy of checkpoint ``ckpt`` as a HF folder at ``out``; returns ``out``."""
    model, step_dir = load_policy(ckpt)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    hf = step_dir / HF_DIR
    for name in TOKENIZER_FILES:
        if (hf / name).is_file():
            shutil.copy2(hf / name, out / name)
    log.info("exported %s to %s (%s)", step_dir, out, model.dtype)
    return out


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl export`` (a bad checkpoint raises CheckpointError, a ValueError)."""
    export_checkpoint(args.ckpt, args.out)
    return 0
