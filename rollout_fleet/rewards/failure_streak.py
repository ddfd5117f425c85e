"""Groups in a row whose every sample's reward failed: when a run can no longer learn.

A sample whose reward fails trains nothing, and a group whose every sample failed is
dropped (rollout_fleet/worker.py). One such group is the reward's problem with that
prompt; hundreds in a row mean the reward fails on everything — a function that raises on
every call, reward servers that stay down — and the run would generate, score and drop
forever at step 0. ``FailureStreak`` counts them (a group with any sample scored ends the
streak) and, at ``reward.max_failed_groups``, gives the reason the driver stops the run
with, quoting the last error.
"""

from __future__ import annotations


class FailureStreak:
    """Consecutive all-failed groups; ``stop_reason`` once ``limit`` is reached (0: never)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"reward.max_failed_groups must be >= 0, got {limit}")
        self.limit = limit
        self.in_a_row = 0
        self.last_error = ""

    def failed(self, error: str) -> None:
        """A group whose every sample's reward failed, the first sample's ``error`` with it."""
        self.in_a_row += 1
        self.last_error = error

    def scored(self) -> None:
        """A group with at least one scored sample: the reward works."""
        self.in_a_row = 0

    @property
    def stop_reason(self) -> str | None:
        """One line naming the count, the key and the last error; None below the limit."""
        if not self.limit or self.in_a_row < self.limit:
            return None
        return (
            f"the reward failed on every sample of {self.in_a_row} groups in a row "
            f"(reward.max_failed_groups={self.limit}); the last error: {self.last_error}"
        )
