"""Await a blocking user function off the event loop, with a timeout that cannot hang the loop.

Reward functions (``rollout_fleet.rewards.runner``) and multi-turn environments
(``rollout_fleet.multi_turn.env_runner``) are user code: they may raise, be
slow, or never return. ``ThreadedCalls.call`` runs one call in its own daemon
thread, at most ``max_workers`` at a time, and awaits it for ``timeout_s``.

Hang protection, and its trade-off: a timed-out call is abandoned: its slot is
freed at once (a hung function cannot block the loop or starve later calls),
but Python cannot kill a thread, so the hung thread keeps its CPU and memory
until it returns or the process exits (daemon threads never block exit).
``num_hung`` counts them. A process pool could kill hung work, but it needs
picklable functions and arguments and costs a process round trip per call;
these functions are short pure-Python checks, so threads win. Run untrusted or
heavy code (code execution) behind its own sandbox service.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallOutcome:
    """What a call ended with: its return value, or the exception it raised."""

    value: Any
    raised: Exception | None
    elapsed_s: float


def _deliver(future: asyncio.Future, outcome: tuple[Any, Exception | None]) -> None:
    if not future.done():  # a timed-out call was already answered
        future.set_result(outcome)


def _run_in_thread(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
) -> None:
    try:
        outcome: tuple[Any, Exception | None] = (fn(**kwargs), None)
    except Exception as err:  # user code: handed to the awaiting caller, which reports it
        outcome = (None, err)
    # RuntimeError: the loop closed while this (abandoned) call ran; nobody waits for it.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_deliver, future, outcome)


class ThreadedCalls:
    """Timeout-bounded calls of blocking functions, each in its own daemon thread."""

    def __init__(self, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._abandoned: list[threading.Thread] = []
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_hung(self) -> int:
        """Timed-out calls whose threads are still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    async def call(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float, thread_name: str
    ) -> CallOutcome:
        """``fn(**kwargs)`` in a thread; ``TimeoutError`` after ``timeout_s`` (thread abandoned)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore belongs to one loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_workers), loop
        async with self._slots:
            future: asyncio.Future = loop.create_future()
            thread = threading.Thread(
                target=_run_in_thread,
                args=(fn, kwargs, loop, future),
                name=thread_name,
                daemon=True,
            )
            start = time.perf_counter()
            thread.start()
            try:
                value, raised = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                self._abandoned.append(thread)
                raise
        return CallOutcome(value, raised, time.perf_counter() - start)
