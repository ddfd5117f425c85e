"""Packing named tensors into flat byte buckets and unpacking them again.

Wire format of one bucket (SGLang's ``load_format="flattened_bucket"``): the raw
bytes of each tensor (contiguous, native byte order) concatenated in the order
of the request's ``names`` and broadcast as one ``uint8`` tensor. The metadata
that travels over HTTP is ``names``, ``dtypes`` (torch dtype names without the
``torch.`` prefix, e.g. ``"bfloat16"``) and ``shapes``.

The sender groups buckets by dtype (every bucket holds one dtype, so each
tensor's offset is a multiple of its item size and the receiver's views need no
copy); the receiver also accepts mixed-dtype buckets, as newer SGLang senders
produce them, copying only a tensor whose offset is misaligned.

Packing copies each tensor into the open bucket of its dtype as soon as it
arrives, so a gathered full tensor can be freed at once. A tensor at least as
large as a bucket is sent alone, as a zero-copy byte view of itself.

Zero-copy tensors (``zero_copy_bytes``): tensors of at least that size are not
packed at all but sent uncopied in SGLang's per-tensor format (``load_format``
None, one broadcast per tensor, several tensors per request), while smaller
ones are still packed; ``zero_copy_bytes=0`` is the per-tensor format
throughout. The sender uses it for CPU buffers (gloo, see
``weight_sync.config.ZERO_COPY_MB``), where a packing copy is a pass over host
memory that costs more than the broadcasts it saves. On the 84 MB fp32 quick
bench model (39 tensors; 9 norms under 1 MiB), on this 2-core machine shared
with other jobs, packing all of it took 14-17 ms per publish, while one
broadcast per tensor instead of one per bucket cost about 7 ms more for the 38
extra calls. Sending the 30 tensors of 1 MiB and more uncopied (one request)
and packing the 9 norms (a second request) took ``fleetrl bench weight-sync
--quick``'s ``vs_per_param`` from 0.87-0.94 (median 0.89, nine runs) to
0.95-1.08 (median 1.01, nine runs alternated with them): on par with one
broadcast per parameter, the per-call saving on the small tensors about
paying for the second request.

Buffers are reused: the sender hands a bucket's buffer back to a ``BufferPool``
once its broadcast and every engine's reply are done, and the receiver keeps one
receive arena per group (``ReceiveArena``). On CPU a fresh buffer of tens of MiB
is a fresh ``mmap``, and touching it page-faults every 4 KiB: measured with gloo
on this machine, broadcasting 84 MB into a fresh buffer took 68 ms against 24 ms
into a reused one, more than the per-call overhead bucketing saves (39 separate
broadcasts of the same bytes: 44 ms). Both reuse only on CPU: CUDA's caching
allocator reuses memory anyway, and a pool there would pin GPU memory.

Left out: compression and quantisation on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling SGLang's endpoints use)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, where: str = "dtype") -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; anything else is a ValueError."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"{where}: unknown dtype {name!r}; accepted: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one tensor inside a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def metas_from_wire(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorMeta]:
    """Validate the HTTP metadata of one update and turn it into ``TensorMeta`` rows."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"update metadata lengths differ: {len(names)} names, {len(dtypes)} dtypes, "
            f"{len(shapes)} shapes"
        )
    metas = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names[{i}]: expected a non-empty string, got {name!r}")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shapes[{i}] ({name}): negative dimension in {list(shape)}")
        metas.append(TensorMeta(name, parse_dtype(dtype, where=f"dtypes[{i}] ({name})"), dims))
    return metas


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` view of a tensor's bytes (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class BufferPool:
    """Free ``uint8`` buffers of one size on one device, reused across buckets and versions.

    Holds at most ``max_free`` buffers (the sender has at most one bucket in flight, one
    packed ahead and one open per dtype), so its memory is bounded by a few buckets.
    """

    def __init__(self, nbytes: int, device: torch.device | str, max_free: int = 4) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        self.nbytes = int(nbytes)
        self.device = torch.device(device)
        self.max_free = max_free
        self._free: list[torch.Tensor] = []
        self.allocations = 0  # fresh buffers made (tests and metrics read it)

    def take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        self.allocations += 1
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buffer: torch.Tensor | None) -> None:
        """Return a buffer from ``take`` (None, or a buffer of another size, is ignored)."""
        if (
            buffer is not None
            and buffer.numel() == self.nbytes
            and buffer.device == self.device
            and len(self._free) < self.max_free
        ):
            self._free.append(buffer)


@dataclass
class Bucket:
    """One update request's tensors, in order: packed in ``flat``, or unpacked in ``parts``.

    ``parts`` (the tensors themselves, in their own dtypes) is set only for the
    per-tensor wire format (SGLang's default ``load_format``), where each tensor
    is its own broadcast: SGLang receives each into ``torch.empty(shape, dtype)``,
    and NCCL needs both sides to agree on element type and count.
    """

    index: int
    metas: list[TensorMeta]
    flat: torch.Tensor  # 1-D uint8
    parts: list[torch.Tensor] | None = None
    pooled: torch.Tensor | None = None  # the pool buffer ``flat`` views, if any

    @property
    def load_format(self) -> str | None:
        """The request's ``load_format``: None (SGLang's per-tensor default) or ``"flattened_bucket"``."""
        return None if self.parts is not None else "flattened_bucket"

    def release(self, pool: BufferPool | None) -> None:
        """Hand the bucket's buffer back to ``pool`` (call once it is no longer in flight)."""
        if pool is not None:
            pool.give(self.pooled)
        self.pooled = None

    @property
    def nbytes(self) -> int:
        if self.parts is not None:
            return sum(int(p.numel()) * p.element_size() for p in self.parts)
        return int(self.flat.numel())

    def broadcast_tensors(self) -> list[torch.Tensor]:
        """What rank 0 broadcasts for this request, in order."""
        return self.parts if self.parts is not None else [self.flat]

    def wire_fields(self) -> dict[str, list]:
        """The ``names``/``dtypes``/``shapes`` fields of the update request for this bucket."""
        return {
            "names": [m.name for m in self.metas],
            "dtypes": [dtype_name(m.dtype) for m in self.metas],
            "shapes": [list(m.shape) for m in self.metas],
        }


@dataclass
class _OpenBucket:
    buffer: torch.Tensor
    used: int = 0
    metas: list[TensorMeta] = field(default_factory=list)


class BucketPacker:
    """Streams ``(name, tensor)`` pairs into dtype-grouped flat buckets of at most ``bucket_bytes``.

    ``add`` returns the buckets that became full (zero, one or two); ``finish``
    returns the partly filled ones: the open zero-copy request first, then the
    flat buckets, oldest first. ``device`` is where bucket buffers live (the
    broadcast device); tensors elsewhere are copied there. Buffers come from
    ``pool`` (a fresh pool if None; give buckets back with ``Bucket.release``
    once sent). With ``zero_copy_bytes`` set, tensors of at least that many
    bytes are held uncopied in per-tensor requests of at most ``bucket_bytes``
    (a larger tensor alone) instead of being packed (see the module docstring).
    """

    def __init__(
        self,
        bucket_bytes: int,
        device: torch.device | str = "cpu",
        pool: BufferPool | None = None,
        *,
        zero_copy_bytes: int | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if zero_copy_bytes is not None and zero_copy_bytes < 0:
            raise ValueError(f"zero_copy_bytes must be >= 0 or None, got {zero_copy_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        self.zero_copy_bytes = zero_copy_bytes
        self.device = torch.device(device)
        self.pool = pool if pool is not None else BufferPool(self.bucket_bytes, self.device)
        if self.pool.nbytes != self.bucket_bytes or self.pool.device != self.device:
            raise ValueError(
                f"buffer pool holds {self.pool.nbytes} bytes on {self.pool.device}, "
                f"the packer needs {self.bucket_bytes} on {self.device}"
            )
        self._open: dict[torch.dtype, _OpenBucket] = {}
        self._unpacked_metas: list[TensorMeta] = []  # the open per-tensor request
        self._unpacked_parts: list[torch.Tensor] = []
        self._unpacked_bytes = 0
        self._next_index = 0
        self._seen: set[str] = set()

    def _emit(
        self,
        metas: list[TensorMeta],
        flat: torch.Tensor,
        pooled: torch.Tensor | None = None,
        parts: list[torch.Tensor] | None = None,
    ) -> Bucket:
        bucket = Bucket(self._next_index, metas, flat, parts=parts, pooled=pooled)
        self._next_index += 1
        return bucket

    def _close_unpacked(self) -> Bucket:
        metas, parts = self._unpacked_metas, self._unpacked_parts
        self._unpacked_metas, self._unpacked_parts, self._unpacked_bytes = [], [], 0
        return self._emit(metas, torch.empty(0, dtype=torch.uint8), parts=parts)

    def _add_unpacked(self, meta: TensorMeta, tensor: torch.Tensor) -> list[Bucket]:
        ready = []
        if self._unpacked_parts and self._unpacked_bytes + meta.nbytes > self.bucket_bytes:
            ready.append(self._close_unpacked())
        self._unpacked_metas.append(meta)
        self._unpacked_parts.append(tensor.detach().to(self.device).contiguous())
        self._unpacked_bytes += meta.nbytes
        return ready

    def _close(self, dtype: torch.dtype) -> Bucket:
        ob = self._open.pop(dtype)
        return self._emit(ob.metas, ob.buffer[: ob.used], ob.buffer)

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        if name in self._seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight stream")
        self._seen.add(name)
        meta = TensorMeta(name, tensor.dtype, tuple(tensor.shape))
        if self.zero_copy_bytes is not None and meta.nbytes >= self.zero_copy_bytes:
            return self._add_unpacked(meta, tensor)
        ready: list[Bucket] = []
        if meta.nbytes >= self.bucket_bytes:
            # Its own bucket, sent as a byte view of the tensor itself.
            ready.append(self._emit([meta], tensor_bytes(tensor.to(self.device))))
            return ready
        ob = self._open.get(meta.dtype)
        if ob is not None and ob.used + meta.nbytes > self.bucket_bytes:
            ready.append(self._close(meta.dtype))
            ob = None
        if ob is None:
            ob = self._open[meta.dtype] = _OpenBucket(self.pool.take())
        ob.buffer[ob.used : ob.used + meta.nbytes].copy_(tensor_bytes(tensor))
        ob.used += meta.nbytes
        ob.metas.append(meta)
        return ready

    def finish(self) -> list[Bucket]:
        ready = [self._close_unpacked()] if self._unpacked_parts else []
        return ready + [self._close(dtype) for dtype in list(self._open)]


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device | str = "cpu",
    pool: BufferPool | None = None,
    *,
    zero_copy_bytes: int | None = None,
) -> Iterator[Bucket]:
    """Lazily pack a stream of named tensors into buckets (see ``BucketPacker``).

    ``zero_copy_bytes=0`` is SGLang's per-tensor format throughout: consecutive tensors
    grouped into requests of about ``bucket_bytes``, each broadcast on its own, uncopied.
    """
    packer = BucketPacker(bucket_bytes, device, pool, zero_copy_bytes=zero_copy_bytes)
    for name, tensor in named_tensors:
        yield from packer.add(name, tensor)
    yield from packer.finish()


def unpack_bucket(
    flat: torch.Tensor, metas: Sequence[TensorMeta]
) -> list[tuple[str, torch.Tensor]]:
    """Split a received flat ``uint8`` buffer back into named tensors (views where aligned)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"bucket buffer must be 1-D uint8, got {flat.dtype} {tuple(flat.shape)}")
    expected = sum(m.nbytes for m in metas)
    if expected != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes but its metadata describes {expected}")
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for meta in metas:
        chunk = flat[offset : offset + meta.nbytes]
        if offset % meta.dtype.itemsize:
            chunk = chunk.clone()  # a view would be misaligned for this dtype
        out.append((meta.name, chunk.view(meta.dtype).reshape(meta.shape)))
        offset += meta.nbytes
    return out
