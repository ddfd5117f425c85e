"""Checking a published version through the engines' own routes.

After a version is sent, every engine is asked what it serves: ``GET
/model_info`` (vLLM: ``GET /weight_info``) must report the version, and ``POST
/get_weights_by_name`` must return the leading rows of a sample of the tensors
exactly as sent. Nothing here needs a route of ours, so the same check runs against
SGLang and the embedded engine; vLLM 0.34 has no route that reads a tensor back, so
a vLLM engine's versions are verified and its values are not. ``SentRows`` keeps those leading rows while the weights
stream past (a few KB per tensor), so no second pass over the weights is made.

An engine may hold the weights in a narrower dtype than the learner sent (an
fp32 learner, a bf16 engine): rows match when they are equal exactly or after
rounding what was sent to bf16 or fp16.

Left out: a full-weights digest (SGLang has no route for one).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fleetrl.log import get_logger

if TYPE_CHECKING:
    from weight_sync.engine_client import EngineClient

log = get_logger(__name__)

_NARROWER = (torch.bfloat16, torch.float16)


class SentRows:
    """The leading ``rows`` rows of every tensor of one stream, in stream order."""

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.rows = int(rows)
        self._kept: dict[str, torch.Tensor] = {}

    def observe(
        self, stream: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, keeping a CPU copy of each tensor's leading rows."""
        for name, tensor in stream:
            flat = tensor.detach().reshape(-1) if tensor.dim() == 0 else tensor.detach()
            self._kept[name] = flat[: self.rows].to("cpu", torch.float32, copy=True)
            yield name, tensor

    @property
    def names(self) -> list[str]:
        return list(self._kept)

    def sample(self, count: int) -> list[str]:
        """Up to ``count`` names spread evenly over the stream, first and last included."""
        names = self.names
        if count >= len(names):
            return names
        if count == 1:
            return names[:1]
        step = (len(names) - 1) / (count - 1)
        return [names[round(i * step)] for i in range(count)]

    def matches(self, name: str, held: list) -> bool:
        """Whether an engine's reply for ``name`` equals what was sent (see the module doc)."""
        sent = self._kept[name]
        try:
            got = torch.tensor(held, dtype=torch.float32)
        except (TypeError, ValueError):
            return False
        if got.shape != sent.shape:
            return False
        if torch.equal(got, sent):
            return True
        return any(torch.equal(got, sent.to(dtype).float()) for dtype in _NARROWER)


class UncheckedEngines:
    """Engines that cannot report weights by name: said once each in the log."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def note(self, name: str) -> None:
        with self._lock:
            if name in self._names:
                return
            self._names.add(name)
        log.info(
            "engine %s cannot report weights by name (SGLang answers /get_weights_by_name for "
            "some architectures only, vLLM for none): its versions are verified, its values are not",
            name,
        )


def check_engine(
    client: EngineClient,
    sent: SentRows,
    names: list[str],
    version: int,
    rows: int,
    unchecked: UncheckedEngines,
) -> str:
    """'' when ``client`` serves ``version`` with the sampled rows as sent, else what differs."""
    served = client.weight_version()
    if served != str(version):
        return f"serves version {served!r}, learner sent {version}"
    for name in names:
        held = client.weights_by_name(name, rows)
        if held is None:
            unchecked.note(client.name)
            return ""
        if not sent.matches(name, held):
            return f"tensor {name} differs from the learner's (POST /get_weights_by_name)"
    return ""
