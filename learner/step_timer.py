"""Seconds per stage of a learner step, under the names verl logs (``timing_s/<stage>``).

``with timer("adv"):`` adds the block's seconds to ``metrics["timing_s/adv"]`` and names
the block ``learner/adv`` in a torch profile (``trainer.profile_steps``), so the metrics
and a trace of the same step agree on what each stage is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StepTimer:
    """``with timer("adv"):`` adds the block's seconds to ``metrics["timing_s/adv"]``, and
    names the block ``learner/adv`` in a profile (``trainer.profile_steps``)."""

    def __init__(self, metrics: dict[str, float]) -> None:
        self.metrics = metrics

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with torch.profiler.record_function(f"learner/{name}"):
                yield
        finally:
            key = f"timing_s/{name}"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - started
