"""Learner rank 0's batches: where a step gets its data.

``BatchSource`` wraps the buffer's control client. The driver asks it (through
``LearnerRole.wait_for_batch``) to wait a short while for B whole groups, so
that between waits it can look at the fleet and at stop signals; the batch it
gets is held here, and the next ``LearnerRole.step`` takes it. The driver
never holds, names or moves a batch: batches travel buffer → rank 0 over
ZeroMQ (Arrow IPC) and rank 0 → the other ranks by broadcast.

The driver queues the next step's wait behind a step's publish and snapshot
(launcher/step_calls.py), so a batch may be held while the driver writes a checkpoint:
``state_dict`` then records the hand-outs before it, which a resumed run serves again.

Left out: prefetching the next batch while a step runs (the buffer already
holds ready groups, so a wait after a step is short when the fleet keeps up).
"""

from __future__ import annotations

from typing import Any


class BatchSource:
    """Holds at most one batch fetched from the buffer until a step takes it."""

    def __init__(self, client: Any) -> None:
        self.client = client  # buffer.transport.BufferClient
        self._held: Any = None

    def wait(self, num_groups: int, version: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``num_groups`` whole groups; True once a batch is held."""
        if self._held is None:
            self._held = self.client.get_batch(num_groups, version, timeout_s)
        return self._held is not None

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint records: the hand-outs trained on, a held batch's not included."""
        state = self.client.state_dict()
        if self._held is not None:  # the last batch fetched: its first hand-out
            state["received_watermark"] = self.client.last_batch.handout_start
        return state

    def take(self) -> Any:
        """The held batch (an Arrow record batch); an error when there is none."""
        batch, self._held = self._held, None
        if batch is None:
            raise RuntimeError("learner rank 0 was asked to step without a batch held")
        return batch

    @property
    def last_info(self) -> Any:
        """The buffer's description of the last batch (hand-out start, refused stale)."""
        return self.client.last_batch
