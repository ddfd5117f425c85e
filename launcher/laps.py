"""Seconds per phase of a sequence that runs once (a run's start-up, its shutdown), for the
one log line that says where the time went (``roles started in 8.7s: starting Ray 2.10s, ...``).

Each ``enter(phase)`` ends the phase before it; ``summary()`` ends the last one and names
them all. Left out: nesting and repeated phases (a name entered twice keeps its last time).
"""

from __future__ import annotations

import time


class Laps:
    """The phases entered so far and the seconds each took."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.current: str | None = None
        self._since = 0.0

    def enter(self, phase: str | None) -> None:
        """Move on to ``phase`` (None: the last phase ends); the previous one's time is kept."""
        now = time.monotonic()
        if self.current is not None:
            self.seconds[self.current] = now - self._since
        self.current, self._since = phase, now

    def summary(self) -> str:
        """``'<total>s: <phase> <s>s, ...'`` over every phase, the current one ended first."""
        self.enter(None)
        total = sum(self.seconds.values())
        return f"{total:.1f}s: " + ", ".join(f"{p} {s:.2f}s" for p, s in self.seconds.items())
