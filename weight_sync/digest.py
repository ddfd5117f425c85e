"""Weights digests: one hex string that is equal exactly when two weight sets are equal bit for bit.

The learner computes it on the stream it publishes, the engine on its loaded
model (``GET /fleetrl/weights_digest``); both should call these functions so the
definition cannot drift:

    digest     = sha256( name_1 utf-8 | raw bytes_1 | name_2 utf-8 | raw bytes_2 | ... ), hex
    per_tensor = {name: sha256(raw bytes).hex}        (``?per_param=1``, for diagnosis)

Raw bytes are the tensor's own dtype, C-contiguous, native (little-endian)
byte order. The order is the stream's: the learner publishes in
``policy.state_dict()`` order, so the engine digests its model in its
``state_dict()`` order with the same names kept - parameters and persistent
buffers, each tied parameter once, under the name ``named_parameters()`` gives
it (``module_named_tensors``). Two models of the same Hugging Face class then
produce the same sequence.

Left out: per-bucket digests (one per version detects a bad sync; the
per-tensor map says which tensor differs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from weight_sync.buckets import tensor_bytes


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor_bytes(tensor.detach().cpu()).numpy())


class StreamDigest:
    """Accumulates the digest as named tensors stream by, in order."""

    def __init__(self) -> None:
        self._total = hashlib.sha256()
        self.per_tensor: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.per_tensor:
            raise ValueError(f"tensor {name!r} digested twice")
        raw = _raw(tensor)
        self._total.update(name.encode("utf-8"))
        self._total.update(raw)
        self.per_tensor[name] = hashlib.sha256(raw).hexdigest()

    def __len__(self) -> int:
        return len(self.per_tensor)

    def hexdigest(self) -> str:
        return self._total.hexdigest()


def state_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of named tensors in the given order (a repeated name is a ValueError)."""
    digest = StreamDigest()
    for name, tensor in named_tensors:
        digest.add(name, tensor)
    return digest.hexdigest()


def module_named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the learner publishes for a model: ``state_dict`` order, parameters and
    persistent buffers, tied parameters once under their ``named_parameters`` name."""
    wanted = {name for name, _ in module.named_parameters()}
    wanted |= {name for name, _ in module.named_buffers()}
    return [(name, t) for name, t in module.state_dict().items() if name in wanted]


def module_digest(module: torch.nn.Module) -> StreamDigest:
    """The digest of a model as the engine serves it (``.hexdigest()``, ``.per_tensor``)."""
    digest = StreamDigest()
    for name, tensor in module_named_tensors(module):
        digest.add(name, tensor)
    return digest
