"""Build a model on the meta device, shard it with FSDP2, then read only this rank's shards.

Why: loading the whole model on every rank before sharding needs one full copy
of the weights per rank in host memory at start (8 ranks of a 70B model: 8 ×
280 GB in fp32). Here each rank allocates only its shards and reads, from the
Hugging Face safetensors files, only the bytes of its slice of each tensor:
host memory at start is about one shard per rank plus a bounded read buffer,
for any number of ranks.

    model = build_sharded(path, kind="causal_lm", device=dev, shard=lambda m: shard_model(m, ...))

Steps: ``from_config`` under ``torch.device("meta")`` (no storage) ->
``prepare(model)`` (gradient checkpointing, head changes) -> ``shard(model)``
(``fully_shard`` per block and root: parameters become meta DTensors) ->
``to_empty(device)`` (allocates each rank's local shards only) -> for every
parameter and persistent buffer, the rank's slice (from
``compute_local_shape_and_global_offset``) is read from the file: a Shard(0)
slice of a row-major tensor is one contiguous byte range, read straight into
the local tensor when the dtypes match (CPU) or through a bounded staging
buffer (dtype change, GPU) -> non-persistent buffers (rotary ``inv_freq``) are
recomputed by the model's own ``_init_weights`` -> tied weights stay tied (DTensor
parameters are swapped in place by ``to_empty``).

Bit-for-bit equal to ``from_pretrained`` (tested with 2 and 4 gloo ranks, which
also measures each rank's RSS growth against its shard size). Resuming from a
learner checkpoint goes through torch DCP, which already reads per rank.

Any family transformers ships loads this way (the causal LM, or for a critic or a
reward model its backbone with a value head: ``learner.value_model``).

Checkpoint keys that transformers renames on load (GPT-NeoX's ``embed_out.weight`` is
its ``lm_head.weight``) are read under the files' names.

Left out: checkpoints whose tensors transformers converts on load (stacked MoE
experts: refused by name), quantised checkpoints, ``.bin`` files.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fleetrl.log import get_logger

log = get_logger(__name__)

# bytes read per call when a slice goes through a staging buffer (dtype change or GPU)
STAGING_BYTES = 64 << 20

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# reward: the reward model being trained, a one-label token classifier whose head has no bias
# (as transformers' *ForSequenceClassification head), read at each sequence's last token
ModelKind = Literal["causal_lm", "token_classification", "reward"]


class SafetensorsEntry:
    """Where one tensor lives: file, dtype, shape, absolute byte offset of its data."""

    __slots__ = ("file", "dtype", "shape", "offset")

    def __init__(self, file: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset


def index_safetensors(folder: str | Path) -> dict[str, SafetensorsEntry]:
    """Name -> entry for every tensor of the folder's ``*.safetensors`` files (headers only)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files (only safetensors is read)")
    entries: dict[str, SafetensorsEntry] = {}
    for file in files:
        with open(file, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
            start = info["data_offsets"][0]
            entries[name] = SafetensorsEntry(
                file, _ST_DTYPES[info["dtype"]], tuple(info["shape"]), base + start
            )
    return entries


def _local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, local shape, global offset) of a DTensor or a plain (replicated) tensor."""
    if hasattr(tensor, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return tensor.to_local(), tuple(shape), tuple(offset)
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


def _read_rows(entry: SafetensorsEntry, fh, first_row: int, rows: int, out: torch.Tensor) -> None:
    """Read rows [first_row, first_row + rows) of ``entry`` (dim 0) into ``out`` (any device, dtype)."""
    row_elems = math.prod(entry.shape[1:]) if len(entry.shape) > 1 else 1
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    row_bytes = row_elems * itemsize
    flat_out = out.view(-1) if out.is_contiguous() else None
    direct = (
        flat_out is not None
        and out.device.type == "cpu"
        and out.dtype == entry.dtype
        and entry.dtype != torch.bfloat16  # numpy has no bfloat16: staged below
    )
    fh.seek(entry.offset + first_row * row_bytes)
    if direct:
        fh.readinto(memoryview(flat_out.numpy()).cast("B"))
        return
    rows_per_chunk = max(1, STAGING_BYTES // max(row_bytes, 1))
    done = 0
    while done < rows:
        n = min(rows_per_chunk, rows - done)
        staging = torch.empty(n * row_bytes, dtype=torch.uint8)
        fh.readinto(memoryview(staging.numpy()))
        chunk = staging.view(entry.dtype).view(n, *entry.shape[1:]) if entry.shape else staging
        target = out[done : done + n] if entry.shape else out
        with torch.no_grad():
            target.copy_(chunk.view(target.shape))
        done += n


def load_local_slices(
    model: nn.Module,
    folder: str | Path,
    *,
    skip_missing: Callable[[str], bool] = lambda _: False,
    file_name: Callable[[str], str] = lambda name: name,
) -> int:
    """Fill every parameter and persistent buffer's local shard from the folder; returns bytes read.

    ``file_name`` maps a state-dict name to the model's own name (a wrapper's renaming,
    e.g. peft's); transformers' renamings of the family's checkpoint keys
    (``fleetrl.models.checkpoint_names``: GPT-NeoX's ``embed_out``) then give the files'.
    A name absent from the files is an error unless ``skip_missing(name)`` (a head or
    adapter the caller initialises); a tensor whose slice is not a dim-0 row range of the
    file is an error (FSDP2 shards dim 0).
    """
    from fleetrl.models.checkpoint_names import CheckpointNames

    entries = index_safetensors(folder)
    names = CheckpointNames.of(model)
    if names.converted:
        raise ValueError(
            f"transformers converts the tensors of {folder} on load ({names.converted[0]}, ...): "
            "the learner reads a file's tensors one to one"
        )
    state = model.state_dict(keep_vars=True)
    handles: dict[Path, object] = {}
    total = 0
    seen: set[int] = set()
    try:
        for name, tensor in state.items():
            if id(tensor) in seen:  # a tied alias, already filled
                continue
            entry = entries.get(names.to_file(file_name(name)))
            if entry is None:
                if skip_missing(name):
                    continue
                raise KeyError(f"{name} is not in the safetensors files of {folder}")
            seen.add(id(tensor))
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {entry.shape} != model shape {tuple(tensor.shape)}"
                )
            local, shape, offset = _local_region(tensor.data if hasattr(tensor, "data") else tensor)
            if any(offset[1:]) or tuple(shape[1:]) != entry.shape[1:]:
                raise ValueError(f"{name}: only dim-0 shards are read (got offset {offset})")
            rows = shape[0] if shape else 1
            if rows == 0 or local.numel() == 0:
                continue
            fh = handles.get(entry.file)
            if fh is None:
                fh = handles[entry.file] = open(entry.file, "rb")  # noqa: SIM115  (closed below)
            _read_rows(entry, fh, offset[0] if offset else 0, rows, local)
            total += local.numel() * entry.dtype.itemsize
    finally:
        for fh in handles.values():
            fh.close()
    return total


def reinit_nonpersistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute buffers that checkpoints do not hold (rotary ``inv_freq``, Gemma's
    ``embed_scale``): ``to_empty`` left garbage.

    Each owning module's buffers are recomputed by the model's own ``_init_weights`` (as
    ``from_pretrained`` does), with the module's parameters and persistent buffers swapped
    for meta tensors meanwhile so that nothing else can be written; a module whose buffers
    that leaves unset is rebuilt from its ``config``. Raises ValueError when neither works.
    """
    from fleetrl.models.family import unwrap

    base = unwrap(model)
    init = getattr(base, "_init_weights", None)
    for module in base.modules():
        names = [
            n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
        ]
        if not names:
            continue
        for n in names:  # a NaN left after the init is a buffer it did not set
            if module._buffers[n].is_floating_point():
                module._buffers[n].fill_(math.nan)
        if init is not None:
            with _only_buffers_writable(module):
                init(module)
        unset = [n for n in names if _has_nan(module._buffers[n])]
        if unset:
            _rebuild_from_config(module, unset, device)


def _has_nan(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and bool(torch.isnan(tensor).any())


@contextmanager
def _only_buffers_writable(module: nn.Module):
    """Parameters and persistent buffers of ``module`` (and below) are meta tensors inside."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                saved.append((sub._parameters, name, param))
                sub._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device="meta"),
                    requires_grad=False,
                )
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                saved.append((sub._buffers, name, buffer))
                sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
    try:
        yield
    finally:
        for table, name, tensor in saved:
            table[name] = tensor


def _rebuild_from_config(module: nn.Module, names: list[str], device: torch.device) -> None:
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"{type(module).__name__} has non-persistent buffers {names} that neither the "
            "model's _init_weights sets nor a config of its own can rebuild"
        )
    with torch.device(device):
        fresh = type(module)(config)
    for n in names:
        module._buffers[n] = fresh._buffers[n].to(module._buffers[n].dtype)


def meta_model(path: str | Path, kind: ModelKind, *, num_labels: int = 1) -> nn.Module:
    """The model's architecture from its config.json, on the meta device (fp32, no storage):
    the causal LM, or (critic, reward model) its backbone with a value head
    (``learner.value_model``, the same for every family); dropout off (``without_dropout``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.value_model import value_model

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    without_dropout(config)
    with torch.device("meta"):
        if kind == "causal_lm":
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            config.num_labels = num_labels
            model = value_model(config, bias=kind == "token_classification")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def without_dropout(config: Any) -> None:
    """Zero every dropout rate of ``config`` (and its sub-configs) in place.

    GPT-2 (``resid_pdrop``, ``attn_pdrop``, ``embd_pdrop``: 0.1) and OPT (``dropout``: 0.1)
    train with dropout by default; a policy with dropout gives different logprobs for the
    same tokens in each forward, so the PPO ratio against the recomputed or behaviour
    logprobs would be noise. TRL's and OpenRLHF's trainers disable it the same way.
    """
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            without_dropout(value)  # a multimodal model's text config


def build_sharded(
    path: str | Path,
    *,
    kind: ModelKind,
    device: torch.device,
    shard: Callable[[nn.Module], nn.Module],
    prepare: Callable[[nn.Module], None] = lambda _: None,
    wrap: Callable[[nn.Module], nn.Module] = lambda model: model,
    skip_missing: Callable[[str], bool] = lambda _: False,
    file_name: Callable[[str], str] = lambda name: name,
) -> nn.Module:
    """Meta init -> ``prepare`` -> ``wrap`` -> ``shard`` -> allocate local shards -> read them.

    ``device`` is where the shards live (the CPU under FSDP2 CPU offload).
    ``wrap`` may put the model inside another module (peft's LoRA wrapper), whose
    state-dict names ``file_name`` maps back to the files'. Tensors that
    ``skip_missing`` names (heads, adapters) are left uninitialised for the caller to fill.
    """
    model = meta_model(path, kind)
    prepare(model)
    model = shard(wrap(model))
    model.to_empty(device=device)
    tied = getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights")
    if tied:  # to_empty gives a plain (unsharded) module's tied parameters a tensor each
        model.tie_weights()
    nbytes = load_local_slices(model, path, skip_missing=skip_missing, file_name=file_name)
    reinit_nonpersistent_buffers(model, device)
    if tied:
        model.tie_weights()
    log.info("loaded %s shards of %s: %.1f MB read", kind, path, nbytes / 2**20)
    return model


def fill_from_full(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the same on every rank) into a sharded ``tensor``."""
    local, shape, offset = _local_region(tensor.data if hasattr(tensor, "data") else tensor)
    region = full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    with torch.no_grad():
        local.copy_(region.to(local.dtype))
