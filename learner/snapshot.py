"""Policy snapshots: the current policy as a plain Hugging Face folder, for offline evaluation.

``trainer.save_hf_freq`` writes one at step 0 and every that many steps to
``<output_dir>/hf_snapshots/step_<N>/``::

    model.safetensors      every parameter and persistent buffer under its Hugging Face
                           name, in the model config's dtype (with LoRA: adapters merged)
    config.json, generation_config.json, tokenizer files    copied from model.path

Why: scoring held-out prompts inside the run (``trainer.test_freq``) blocks the
learner while the rollout fleet keeps generating, so a run's clock either counts
validation or, when validation time is subtracted, hides the generation that
happened meanwhile; a synchronous run (η = 0) hides its whole next batch that
way. A snapshot costs one gather and one small file write, the same at every η,
and ``launcher.evaluate`` scores it afterwards with the run's own validation
machinery (AReaL evaluates saved checkpoints the same way). A snapshot is also
what ``transformers.AutoModelForCausalLM.from_pretrained`` or an SGLang server
loads directly.

Collective: every learner rank iterates the tensor stream (the gather is
collective); rank 0 writes. Atomic: written to ``step_<N>.tmp`` and renamed.
Left out: the critic, optimizer state (use a checkpoint to resume), and sharded
files (one ``model.safetensors``; fine for the models a snapshot is meant for).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from fleetrl.log import get_logger
from learner.checkpoint import TOKENIZER_FILES, step_dir_name
from weight_sync.errors import drain_stream

log = get_logger(__name__)

SNAPSHOT_DIR = "hf_snapshots"
WEIGHTS_FILE = "model.safetensors"
_COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def snapshot_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / SNAPSHOT_DIR


def config_dtype(model_path: Path) -> torch.dtype | None:
    """The dtype config.json declares (``dtype`` or the older ``torch_dtype``), if any."""
    config = json.loads((model_path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def write_hf_snapshot(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    model_path: str | Path,
    root: str | Path,
    step: int,
    rank: int,
) -> Path:
    """Write ``root/step_<step>`` from ``named_tensors`` (consumed on every rank; rank 0 writes).

    Returns the snapshot's folder (on every rank). ``model_path`` is the folder the
    policy was built from: its config and tokenizer files are copied beside the weights.
    """
    from safetensors.torch import save_file

    model_path = Path(model_path)
    final = Path(root) / step_dir_name(step)
    if rank != 0:
        drain_stream(named_tensors)  # take part in every gather, keep nothing
        return final
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"policy snapshot: {model_path}/config.json is missing (model.path must be the "
            "Hugging Face folder the policy was built from)"
        )
    dtype = config_dtype(model_path)
    tensors = {
        name: (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)
        .detach()
        .cpu()
        .contiguous()
        for name, tensor in named_tensors
    }
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "step": str(step)})
    for name in _COPIED:
        if (model_path / name).is_file():
            shutil.copy2(model_path / name, tmp / name)
    if final.exists():  # the same step written again (a resumed run): the newer one wins
        shutil.rmtree(final)
    tmp.rename(final)
    log.info("policy snapshot of step %d written to %s (%d tensors)", step, final, len(tensors))
    return final


def snapshot_steps(root: str | Path) -> list[tuple[int, Path]]:
    """Complete snapshots under ``root`` as (step, folder), by step (``.tmp`` folders skipped)."""
    root = Path(root)
    found = []
    for path in root.glob("step_*") if root.is_dir() else ():
        suffix = path.name.removeprefix("step_")
        if suffix.isdigit() and (path / WEIGHTS_FILE).is_file():
            found.append((int(suffix), path))
    return sorted(found)
