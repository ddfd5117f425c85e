"""What a failed weight sync reports, and the small helpers both sides of a failure use.

``WeightSyncError`` names the engines that failed (and whether the survivors
hold partial weights); ``drain_stream`` lets learner ranks other than 0 drive
their collectives to the end of a stream; ``describe`` renders
``{engine: why}`` as one line.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weight_sync.engine_client import EngineCallError
from weight_sync.metrics import SyncMetrics


class WeightSyncError(RuntimeError):
    """Weight sync failed for the named engines (they were dropped unless only verification failed).

    ``partial``: surviving engines that hold part of the version and stay paused
    until the next ``publish`` (``needs_resend``). ``metrics``: what was measured
    before failing.
    """

    def __init__(
        self,
        message: str,
        *,
        engines: list[str],
        version: int | None = None,
        metrics: SyncMetrics | None = None,
        partial: list[str] | None = None,
    ) -> None:
        self.engines = engines
        self.version = version
        self.metrics = metrics
        self.partial = list(partial or [])
        super().__init__(message)

    @property
    def needs_resend(self) -> bool:
        """Some engines hold part of the version: publish again (the same version is fine)."""
        return bool(self.partial)


def drain_stream(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Consume a weight stream on a learner rank other than 0 (drives its collectives); returns the count."""
    count = 0
    for _ in named_tensors:
        count += 1
    return count


class BucketFailure(Exception):
    """Internal: a bucket's broadcast or update call failed (the group must be aborted)."""

    def __init__(self, reason: str, errors: dict[str, EngineCallError]) -> None:
        self.reason = reason
        self.errors = errors
        super().__init__(reason)


def describe(errors: dict[str, str], what: str) -> str:
    return f"{what}: " + "; ".join(errors[name] for name in sorted(errors))
