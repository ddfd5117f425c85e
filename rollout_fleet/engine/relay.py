"""The bridge between the HTTP event loop and the scheduler thread, batched both ways.

The scheduler thread produces many per-sequence events per step; waking the HTTP
event loop once per event makes the two threads fight for the GIL. ``EventRelay``
queues them and schedules a single drain on the loop per burst.

The other way, a burst of ``/generate`` requests (a rollout worker sends a GRPO
group's n samples as n requests) would be n scheduler commands, each waking the
scheduler thread and, when its future completes, the loop again.
``SubmitBatcher`` collects the sequences that handlers submit during one loop
iteration and hands them over as one command, and no handler waits for it
(a submission cannot fail; the handler waits for its sequences' events).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
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


class SubmitBatcher:
    """Hands the sequences submitted during one loop iteration to the scheduler together.

    ``add`` (on the loop) queues and, for the first item of an iteration, schedules
    ``flush`` with ``call_soon``; ``flush`` passes everything queued to ``submit`` (the
    scheduler's, which only enqueues a command). Call ``flush`` directly before any
    command that must follow these submissions (an abort of their rids).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, submit: Callable[[list], Any]) -> None:
        self.loop = loop
        self._submit = submit
        self._pending: list = []

    def add(self, items: list) -> None:
        if not self._pending:
            self.loop.call_soon(self.flush)
        self._pending.extend(items)

    def flush(self) -> None:
        if self._pending:
            items, self._pending = self._pending, []
            self._submit(items)
