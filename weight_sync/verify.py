"""Checking a published version through SGLang's own routes.

After a version is sent, every engine is asked what it serves: ``GET
/model_info`` must report the version, and ``POST /get_weights_by_name`` must
return the leading rows of a sample of the tensors exactly as sent. Nothing
here needs a route of ours, so the same check runs against SGLang and the
embedded engine. ``SentRows`` keeps those leading rows while the weights
stream past (a few KB per tensor), so no second pass over the weights is made.

An engine may hold the weights in a narrower dtype than the learner sent (an
fp32 learner, a bf16 engine): rows match when they are equal exactly or after
rounding what was sent to bf16 or fp16.

Left out: a full-weights digest (SGLang has no route for one).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

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
