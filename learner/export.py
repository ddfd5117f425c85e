"""``fleetrl export --ckpt DIR --out DIR [--merged]``: a Hugging Face folder from a learner checkpoint.

Single process, no process group: the policy's sharded weights are read from the
DCP checkpoint with ``dcp.load(..., no_dist=True)`` straight into a model built
from the checkpoint's own ``hf/config.json`` (materialised empty, then filled),
saved as safetensors in the config's dtype, with the tokenizer files copied
from the checkpoint's ``hf/`` folder (written there from the original model path
at save time, so the export does not depend on that path still existing).

``--ckpt`` may be one ``step_<N>`` folder or a checkpoint root, in which case
the latest complete checkpoint is used.

A LoRA run's checkpoint (its meta.json holds the adapter config) holds the
adapters and their optimizer state only, not the frozen base. It exports as a
peft adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``,
loadable with ``peft.PeftModel.from_pretrained`` on the base model), plus with
``--merged`` the merged Hugging Face model in ``<out>/merged``, for which the
base weights are read from the run's model folder (meta.json's ``model_path``:
it must still exist). ``load_policy`` (also used by ``fleetrl weights push``)
always gives a plain model: merged for LoRA.

Left out: exporting the critic.
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
MERGED_DIR = "merged"  # LoRA export: the merged Hugging Face model, next to the adapter


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if (path / COMPLETE_MARKER).exists() or path.name.startswith("step_"):
        read_meta(path)  # raises CheckpointError naming what is wrong
        return path
    found = latest_complete_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint under {path}")
    return found


def _empty_policy(step_dir: Path, adapter_config: dict[str, Any] | None) -> Any:
    """The checkpoint's policy architecture on the CPU, uninitialised (peft-wrapped under LoRA)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = step_dir / HF_DIR
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"checkpoint {step_dir} has no {HF_DIR}/config.json")
    config = AutoConfig.from_pretrained(str(hf), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if adapter_config is not None:
            import peft

            from learner.lora import ADAPTER_NAME

            model = peft.get_peft_model(model, peft.get_peft_config(dict(adapter_config)))
            # peft records the folder the architecture came from (the checkpoint's hf/, which
            # has no weights); the adapter's base is the model the learner trained from
            base = adapter_config.get("base_model_name_or_path")
            model.peft_config[ADAPTER_NAME].base_model_name_or_path = base
    return model.to_empty(device="cpu")


def _read_policy(model: Any, step_dir: Path, required: set[str]) -> None:
    """Fill ``model``'s tensors (named as the learner's policy) that the checkpoint's DCP files
    hold; every name in ``required`` must be there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    target = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if _POLICY_PREFIX + name in stored
    }
    missing = required - set(target)
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


def _read_lora_base(model: Any, step_dir: Path) -> None:
    """The frozen base weights of a LoRA checkpoint's policy, from the run's model folder."""
    import torch

    from learner import lora
    from learner.sharded_load import load_local_slices, reinit_nonpersistent_buffers

    base = Path(read_meta(step_dir)["model_path"])
    if not base.is_dir():
        raise CheckpointError(
            f"checkpoint {step_dir} is a LoRA run: its base model {base} (meta.json model_path) "
            "is needed for the merged model and does not exist"
        )
    load_local_slices(model, base, skip_missing=lora.is_adapter, file_name=lora.checkpoint_name)
    reinit_nonpersistent_buffers(model, torch.device("cpu"))
    model.tie_weights()


def _config_dtype(model: Any) -> Any:
    import torch

    dtype = getattr(model.config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_lora_policy(ckpt: str | Path, *, with_base: bool) -> tuple[Any, Path]:
    """The peft-wrapped (fp32) policy of a LoRA checkpoint, and its step folder.

    ``with_base``: also read the frozen base weights (from the run's model folder);
    without, they are left uninitialised (enough to save the adapter). A checkpoint
    of full training raises CheckpointError.
    """
    from learner import lora

    step_dir = resolve_checkpoint(ckpt)
    adapter_config = read_meta(step_dir).get("adapter_config")
    if adapter_config is None:
        raise CheckpointError(f"checkpoint {step_dir} is not a LoRA run (learner.lora.rank was 0)")
    model = _empty_policy(step_dir, adapter_config)
    _read_policy(model, step_dir, {n for n, _ in model.named_parameters() if lora.is_adapter(n)})
    if with_base:
        _read_lora_base(model, step_dir)
    return model, step_dir


def load_policy(ckpt: str | Path) -> tuple[Any, Path]:
    """The policy of checkpoint ``ckpt`` as a CPU Hugging Face model in its config's dtype
    (a LoRA run's adapters merged in), and the step folder it came from (a bad
    checkpoint raises CheckpointError)."""
    step_dir = resolve_checkpoint(ckpt)
    if read_meta(step_dir).get("adapter_config") is not None:
        peft_model, _ = load_lora_policy(step_dir, with_base=True)
        model = peft_model.merge_and_unload()
    else:
        model = _empty_policy(step_dir, None)
        _read_policy(model, step_dir, {n for n, _ in model.named_parameters()})
    return model.to(_config_dtype(model)), step_dir


def _copy_tokenizer(step_dir: Path, out: Path) -> None:
    hf = step_dir / HF_DIR
    for name in TOKENIZER_FILES:
        if (hf / name).is_file():
            shutil.copy2(hf / name, out / name)


def export_checkpoint(ckpt: str | Path, out: str | Path, *, merged: bool = False) -> Path:
    """Write the policy of checkpoint ``ckpt`` at ``out``; returns ``out``.

    Full training: a Hugging Face folder. LoRA: the peft adapter folder
    (``adapter_model.safetensors``, ``adapter_config.json``), and with ``merged``
    also the merged Hugging Face model in ``out/merged``.
    """
    step_dir = resolve_checkpoint(ckpt)
    if read_meta(step_dir).get("kind") == "reward_model":
        raise CheckpointError(
            f"checkpoint {step_dir} is a reward-model run's: its Hugging Face folder is the "
            "run's reward_model/ (written at every save by `fleetrl rm train`)"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if read_meta(step_dir).get("adapter_config") is None:
        if merged:
            log.info("%s is a full-training checkpoint: its export is already a whole model", ckpt)
        model, _ = load_policy(step_dir)
        model.save_pretrained(str(out), safe_serialization=True)
        _copy_tokenizer(step_dir, out)
        log.info("exported %s to %s (%s)", step_dir, out, model.dtype)
        return out
    peft_model, _ = load_lora_policy(step_dir, with_base=merged)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    _copy_tokenizer(step_dir, out)
    log.info("exported the LoRA adapter of %s to %s", step_dir, out)
    if merged:
        model = peft_model.merge_and_unload()
        model = model.to(_config_dtype(model))
        model.save_pretrained(str(out / MERGED_DIR), safe_serialization=True)
        _copy_tokenizer(step_dir, out / MERGED_DIR)
        log.info("exported the merged model to %s (%s)", out / MERGED_DIR, model.dtype)
    return out


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl export`` (a bad checkpoint raises CheckpointError, a ValueError)."""
    export_checkpoint(args.ckpt, args.out, merged=args.merged)
    return 0
