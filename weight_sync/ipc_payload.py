"""The payload of ``/update_weights_from_tensor``: tensors shared by handle, not by value.

SGLang 0.5.23's route takes ``serialized_named_tensors``: one entry per engine TP
rank, each a base64 string of ``MultiprocessingSerializer.serialize(obj)``, which is
``multiprocessing.reduction.ForkingPickler`` over ``obj``. With
``load_format="flattened_bucket"`` the object is the dict SGLang's trainers send::

    {"flattened_tensor": <1-D uint8 tensor>,
     "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel), ...]}

ForkingPickler writes a tensor as a handle to its memory, never its bytes: a CUDA
tensor as a CUDA IPC handle (``rebuild_cuda_tensor``), a CPU tensor in shared memory
as the name of its ``/dev/shm`` file (``rebuild_storage_filename``, torch's
``file_system`` sharing strategy). The receiver maps that memory and copies from it,
so the producer must keep the buffer alive, unchanged, until the engine has answered
(slime saw corrupted weights when it did not): ``weight_sync.tensor_push`` does. Each
payload is for one consuming process (``encode_bucket`` says why): an engine with TP t
gets t entries, each encoded apart.

Producer (``encode_bucket``): the bytes SGLang's serializer writes for that dict,
without importing SGLang (its package import costs seconds of CPU in every learner
process): a pure-Python pickler with ForkingPickler's reducers, which writes our
``BucketEntry`` under SGLang's global name ``sglang.srt.weight_sync.tensor_bucket.
FlattenedTensorMetadata`` (the same fields, in the same order). That SGLang's own
``SafeUnpickler`` and weight updater load what we send is tested against SGLang's code
(tests/conformance/test_tensor_push.py), not against this module.

Consumer (``decode_payload``, the embedded engine): the payload is a pickle, so it is
decoded only where SGLang's trust model holds (the engine's route checks the caller:
this host, with the run's key) and only by ``RestrictedUnpickler``, which admits the
globals in ``ALLOWED_GLOBALS`` and torch dtypes, nothing else: torch's rebuild
functions for shared-memory and CUDA tensors (a shared-memory segment must hold the
bytes its storage claims, and a tensor must lie inside its storage, both checked before
anything is mapped or viewed), ``torch.Tensor``, ``torch.Size``,
``UntypedStorage`` / ``TypedStorage`` and SGLang's metadata class (read as ``BucketEntry``). Any other
global (``os.system``, ``builtins.eval``, a file-descriptor handle) raises
``PayloadError`` naming it before anything is called.

Left out: the ``LocalSerializedTensor`` wrapping (per-rank nested payloads) and
file-descriptor sharing (``rebuild_storage_fd`` needs the producer's resource-sharer
socket and authentication key, which unrelated processes do not share).
"""

from __future__ import annotations

import base64
import binascii
import copyreg
import io
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions as reductions

LOAD_FORMATS = (None, "flattened_bucket")
SGLANG_METADATA_GLOBAL = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


class PayloadError(ValueError):
    """A payload that is refused: a global not admitted, or a structure that is not a bucket."""


@dataclass
class BucketEntry:
    """One tensor inside a flat bucket: SGLang's ``FlattenedTensorMetadata``, field for field."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# ---- producer ---------------------------------------------------------------------------


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """Torch's ``file_system`` sharing strategy for the block: shared CPU memory is then a
    named ``/dev/shm`` file that any process on the host can map (the default strategy
    passes a file descriptor, which only reaches processes sharing the producer's
    multiprocessing key). The strategy is process-wide, so it is set only for the block."""
    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 buffer an engine can map: shared memory on CPU, device memory on CUDA."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with file_system_sharing():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


CUDA_DEVICE_ARG = 6  # the device among rebuild_cuda_tensor's arguments (SGLang's constant)


def _reduce_tensor_by_uuid(reduce: Callable[[torch.Tensor], Any]) -> Callable:
    """torch's tensor reducer, naming a CUDA device by its UUID instead of this process's
    index (what SGLang's patched reducer writes): the engine may number its GPUs otherwise."""

    def reduced(tensor: torch.Tensor) -> Any:
        rebuild, args = reduce(tensor)
        if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[CUDA_DEVICE_ARG], int):
            uuid = str(torch.cuda.get_device_properties(args[CUDA_DEVICE_ARG]).uuid)
            args = (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])
        return rebuild, args

    return reduced


class _PayloadPickler(pickle._Pickler):  # type: ignore[name-defined]  # the pure-Python one
    """ForkingPickler's reducers (torch's tensor and storage handles; CUDA devices by
    UUID), SGLang's class name for the bucket metadata."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)  # as ForkingPickler
        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)  # torch registers its reducers here
        for cls, reduce in list(table.items()):
            if isinstance(cls, type) and issubclass(cls, torch.Tensor):
                table[cls] = _reduce_tensor_by_uuid(reduce)
        self.dispatch_table = table

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is BucketEntry:
            module, qualname = SGLANG_METADATA_GLOBAL
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def encode_bucket(flat: torch.Tensor, entries: list[BucketEntry]) -> str:
    """One TP rank's ``serialized_named_tensors`` entry for a flattened bucket (base64).

    ``flat`` must be a 1-D uint8 tensor from ``shared_buffer`` (a CPU one in shared
    memory, or on a CUDA device): the payload names its memory, it does not copy it.
    Encode once per process that will open it: torch counts one reference to the shared
    memory per pickling and the process that unpickles it drops that one (two processes
    opening one payload drop it twice, and the memory is unlinked under the producer).
    """
    if flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError(f"a bucket is a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    if flat.device.type == "cpu" and not flat.is_shared():
        raise ValueError("a CPU bucket must be in shared memory (Tensor.share_memory_())")
    out = io.BytesIO()
    with file_system_sharing():
        _PayloadPickler(out).dump({"flattened_tensor": flat, "metadata": list(entries)})
    return base64.b64encode(out.getvalue()).decode("ascii")


# ---- consumer ---------------------------------------------------------------------------


def _cuda_device_index(device: Any) -> int:
    """A device index from an index or a GPU UUID (what SGLang's patched reducer writes)."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == str(device):
            return index
    raise PayloadError(f"payload names CUDA device {device!r}, which this process does not see")


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` whose device argument may be a GPU UUID (as SGLang's
    ``_rebuild_cuda_tensor_modified`` takes it): our producer and SGLang's write UUIDs."""
    args = list(args)
    args[CUDA_DEVICE_ARG] = _cuda_device_index(args[CUDA_DEVICE_ARG])
    return reductions.rebuild_cuda_tensor(*args)


SHM_DIR = Path("/dev/shm")
# torch's shared-memory segments hold a reference count block of this many bytes beside
# the data (RefcountedMapAllocator's map_alloc_alignment)
SHM_HEADER_BYTES = 64


def _extent_bytes(size: Any, stride: Any, offset: int, itemsize: int) -> int:
    """Bytes from the storage's start to the end of a tensor's last element."""
    size, stride = tuple(size), tuple(stride)
    if offset < 0 or len(size) != len(stride) or any(n < 0 for n in size) or any(st < 0 for st in stride):  # fmt: skip
        raise PayloadError(f"payload tensor layout is refused: size {size}, stride {stride}, offset {offset}")  # fmt: skip
    if 0 in size:
        return 0
    last = offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
    return (last + 1) * itemsize


def _rebuild_storage_filename_checked(cls: Any, manager: Any, handle: bytes, size: int, dtype: Any = None):  # fmt: skip
    """torch's ``rebuild_storage_filename``, after checking the named ``/dev/shm`` segment
    holds the bytes claimed: torch would otherwise grow another process's segment to the
    claimed size (any size) and read zeros as weights."""
    name = handle.decode("utf-8", "replace").lstrip("/") if isinstance(handle, bytes) else ""
    if not name or "/" in name or name in (".", ".."):
        raise PayloadError(f"payload names shared memory {handle!r}, not a segment of /dev/shm")
    nbytes = size * (torch._utils._element_size(dtype) if dtype is not None else 1)
    try:
        held = (SHM_DIR / name).stat().st_size - SHM_HEADER_BYTES
    except OSError as err:
        raise PayloadError(f"payload's shared memory {name} cannot be read: {err}") from None
    if nbytes < 0 or held < nbytes:
        raise PayloadError(f"payload claims {nbytes} bytes of shared memory {name}, which holds {max(held, 0)}")  # fmt: skip
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


def _rebuild_tensor_checked(cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    """torch's ``rebuild_tensor``, after checking the tensor lies inside its storage (torch
    would crash the process setting a larger one on shared memory)."""
    offset, size, stride, _ = metadata
    if type(storage) is torch.storage.TypedStorage:  # read without its deprecation warning
        itemsize, nbytes = storage.dtype.itemsize, storage._untyped_storage.nbytes()
    else:  # torch's rebuild reads bytes then (an UntypedStorage)
        itemsize, nbytes = 1, storage.nbytes()
    if _extent_bytes(size, stride, offset, itemsize) > nbytes:
        raise PayloadError(f"payload tensor {tuple(size)} reaches past its {nbytes}-byte storage")  # fmt: skip
    return reductions.rebuild_tensor(cls, storage, metadata)


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor_checked,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): (
        _rebuild_storage_filename_checked
    ),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor_by_uuid,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor_by_uuid,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,  # a CUDA tensor's storage_cls
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    SGLANG_METADATA_GLOBAL: BucketEntry,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a tensor payload; refuses every global but ``ALLOWED_GLOBALS`` and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        target = ALLOWED_GLOBALS.get((module, name))
        if target is not None:
            return target
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise PayloadError(
            f"payload refused: global {module}.{name} is not admitted (a tensor payload "
            "needs only torch's rebuild functions, torch dtypes and SGLang's bucket metadata)"
        )


def _loads(entry: str | bytes) -> Any:
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as err:
        raise PayloadError(f"serialized_named_tensors entry is not base64: {err}") from None
    try:
        return RestrictedUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, RuntimeError) as err:
        raise PayloadError(f"serialized_named_tensors entry does not unpickle: {err}") from None


def _bucket_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise PayloadError("a flattened_bucket payload is {'flattened_tensor', 'metadata'}")
    flat, entries = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
        raise PayloadError("flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(entries, list) or not all(isinstance(e, BucketEntry) for e in entries):
        raise PayloadError("metadata must be a list of FlattenedTensorMetadata")
    out = []
    for e in entries:
        nbytes = torch.Size(e.shape).numel() * e.dtype.itemsize
        if not (
            e.start_idx >= 0 and e.end_idx - e.start_idx == nbytes and e.end_idx <= flat.numel()
        ):
            raise PayloadError(
                f"bucket entry {e.name!r}: bytes [{e.start_idx}, {e.end_idx}) do not hold "
                f"{tuple(e.shape)} {e.dtype} inside a {flat.numel()}-byte bucket"
            )
        piece = flat[e.start_idx : e.end_idx]
        if e.start_idx % e.dtype.itemsize:  # a view needs an aligned offset
            piece = piece.clone()
        out.append((e.name, piece.view(e.dtype).reshape(e.shape)))
    return out


def _pair_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    ok = isinstance(obj, list) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor) for p in obj
    )  # fmt: skip
    if not ok:
        raise PayloadError("a payload without load_format is a list of (name, tensor) pairs")
    return list(obj)


DECODERS: dict[str | None, Callable[[Any], list[tuple[str, torch.Tensor]]]] = {
    "flattened_bucket": _bucket_tensors,
    None: _pair_tensors,
}


def decode_payload(entry: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's entry -> ``(name, tensor)`` pairs that view the producer's memory.

    The views are valid while the producer keeps its buffer: copy them (load the
    weights) before answering the request.
    """
    if load_format not in DECODERS:
        raise PayloadError(f"load_format {load_format!r}; accepted: {list(LOAD_FORMATS)}")
    return DECODERS[load_format](_loads(entry))
