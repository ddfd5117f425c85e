"""Sharded, atomic learner checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint (``<root>/step_<N>/``)::

    .metadata, __<rank>_*.distcp   DCP: sharded model(s) + optimizer(s), any world size can load
                                   (a LoRA policy: its adapters only; the frozen base is
                                   re-read from the model folder)
    rng_rank<R>.pt                 torch (CPU, CUDA) RNG state of rank R
    rng_rank<R>.json               numpy and Python RNG state of rank R
    meta.json                      step, policy version, world size, scheduler and KL-controller
                                   state, model path, caller's extra_state (data cursor, ...)
    hf/                            config.json and tokenizer files of the policy (for export)
    COMPLETE                       written last; its presence means the checkpoint is whole

Atomicity: everything is written to ``step_<N>.tmp``; after a barrier rank 0
writes ``COMPLETE`` and renames the folder to ``step_<N>``. A crash leaves at
most a ``.tmp`` folder, which ``latest_complete_checkpoint`` ignores (with a
log line), as it does a folder whose marker, metadata or rank files are missing
or whose meta.json does not parse; it then falls back to the previous one.
``torch.load`` is only ever called with ``weights_only=True``, but ``dcp.load`` (torch's
reader) unpickles ``.metadata`` and non-tensor entries: a checkpoint is trusted input.

What a ``LearnerWorker`` puts into ``state`` and ``meta`` (and restores from
them) is ``learner.worker_checkpoint``; this module knows only the folder.

All ranks must see the same filesystem (a local disk on one node, or a shared
one across nodes). Left out: asynchronous saving, keeping only the last k.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fleetrl.log import get_logger

log = get_logger(__name__)

COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
HF_DIR = "hf"
_STEP_RE = re.compile(r"^step_(\d+)$")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
_HF_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete, inconsistent)."""


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    plain = {
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    kind, keys, *rest = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))


def write_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    model_path: str | Path,
) -> Path:
    """Collective: every rank calls it. ``state`` is DCP-stateful; ``meta`` is JSON (rank 0's wins)."""
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    tensors, plain = rng_state()
    torch.save(tensors, tmp / f"rng_rank{rank}.pt")
    (tmp / f"rng_rank{rank}.json").write_text(json.dumps(plain))
    dist.barrier()
    if rank == 0:
        hf = tmp / HF_DIR
        hf.mkdir()
        for name in _HF_FILES:
            src = Path(model_path) / name
            if src.is_file():
                shutil.copy2(src, hf / name)
        (tmp / META_FILE).write_text(
            json.dumps({**meta, "step": step, "world_size": world, "model_path": str(model_path)})
        )
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        if final.exists():  # re-saving the same step: replace the old one
            shutil.rmtree(final)
        tmp.rename(final)
        log.info("checkpoint step %d written to %s", step, final)
    dist.barrier()
    return final


def read_meta(step_dir: str | Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint; CheckpointError naming what is wrong otherwise."""
    step_dir = Path(step_dir)
    problem = checkpoint_problem(step_dir)
    if problem:
        raise CheckpointError(f"checkpoint {step_dir} is not usable: {problem}")
    return json.loads((step_dir / META_FILE).read_text())


def checkpoint_problem(step_dir: Path) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint, or None if it is."""
    if not step_dir.is_dir():
        return "not a directory"
    if not (step_dir / COMPLETE_MARKER).is_file():
        return f"no {COMPLETE_MARKER} marker (interrupted save)"
    if not (step_dir / ".metadata").is_file():
        return "no DCP .metadata file"
    try:
        meta = json.loads((step_dir / META_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{META_FILE} unreadable: {err}"
    if not isinstance(meta, dict) or "step" not in meta or "world_size" not in meta:
        return f"{META_FILE} lacks step/world_size"
    for rank in range(int(meta["world_size"])):
        if not (step_dir / f"rng_rank{rank}.pt").is_file():
            return f"rng_rank{rank}.pt missing"
    if not list(step_dir.glob("*.distcp")):
        return "no .distcp shard files"
    return None


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The highest ``step_<N>`` under ``root`` that is complete; skipped ones are logged."""
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match:
            candidates.append((int(match.group(1)), child))
        elif child.name.startswith("step_") and child.name.endswith(".tmp"):
            log.warning("skipping checkpoint %s: interrupted save (.tmp)", child)
    for _step, path in sorted(candidates, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s; falling back to an earlier one", path, problem)
    return None


def read_checkpoint(step_dir: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Collective: load DCP ``state`` in place and this rank's RNG; returns meta.json."""
    import torch.distributed.checkpoint as dcp

    step_dir = Path(step_dir)
    meta = read_meta(step_dir)
    dcp.load(state, checkpoint_id=str(step_dir))
    rank = dist.get_rank()
    if int(meta["world_size"]) == dist.get_world_size():
        tensors = torch.load(step_dir / f"rng_rank{rank}.pt", weights_only=True)
        plain = json.loads((step_dir / f"rng_rank{rank}.json").read_text())
        set_rng_state(tensors, plain)
    else:
        log.warning(
            "checkpoint %s was saved by %s ranks, loading on %d: RNG states not restored",
            step_dir,
            meta["world_size"],
            dist.get_world_size(),
        )
    return meta
