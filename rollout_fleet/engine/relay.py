"""Scheduler-thread events carried to an asyncio loop with one wake-up per decode step.

The scheduler thread produces many per-sequence events per step; waking the HTTP
event loop once per event makes the two threads fight for the GIL. ``EventRelay``
queues them and schedules a single drain on the loop per burst.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any


class EventRelay:
    """Carries scheduler events to one event loop: ``put`` (scheduler thread) only queues;
    ``wake`` (the scheduler's delivery hook, once per burst) schedules one drain on the loop.

    One loop wake-up per decode step instead of one per finished sequence keeps the HTTP
    thread from taking the GIL between the scheduler's per-sequence callbacks.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._drain_scheduled = False

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        self._pending.append((queue, item))

    def wake(self) -> None:
        if not self._pending:
            return
        with self._lock:
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        # Clear the flag before popping: an item queued after the last pop wakes a new drain.
        with self._lock:
            self._drain_scheduled = False
        while self._pending:
            queue, item = self._pending.popleft()
            queue.put_nowait(item)
