"""Await a blocking user function off the event loop, with a timeout that cannot hang the loop.

Reward functions (``rollout_fleet.rewards.runner``) and multi-turn environments
(``rollout_fleet.multi_turn.env_runner``) are user code: they may raise, be
slow, or never return. ``ThreadedCalls.call`` runs one call on a daemon worker
thread, at most ``max_workers`` at a time, and awaits it for ``timeout_s``.

Workers are reused: an idle one takes the next call from its own queue, so a call
costs a queue hand-off, not a thread's start (starting a thread per call was a
quarter of the rollout process's time at the CPU demo's 128 rule-scored samples a
step: the start waits for the new thread to run, which on a busy machine means
for the GIL and a core).

Hang protection, and its trade-off: a timed-out call is abandoned: its worker is
retired and its slot freed at once (a hung function cannot block the loop or
starve later calls; a fresh worker takes the next call), but Python cannot kill a
thread, so the hung thread keeps its CPU and memory until it returns (then it
exits) or the process exits (daemon threads never block exit). ``num_hung``
counts them. A process pool could kill hung work, but it needs picklable
functions and arguments and costs a process round trip per call; these
functions are short pure-Python checks, so threads win. Run untrusted or heavy
code (code execution) behind its own sandbox service.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
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


_Job = tuple[Callable[..., Any], dict[str, Any], asyncio.AbstractEventLoop, asyncio.Future, str]


class _Worker:
    """One daemon thread running the calls put on its queue, one at a time, until it is
    retired (``None``) or abandoned (a timed-out call: it exits once that call returns)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(target=self._loop, name="threaded-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, kwargs, loop, future, name = job
            self.thread.name = name
            try:
                outcome: tuple[Any, Exception | None] = (fn(**kwargs), None)
            except Exception as err:  # user code: handed to the awaiting caller, which reports it
                outcome = (None, err)
            # RuntimeError: the loop closed while this (abandoned) call ran; nobody waits for it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, future, outcome)
            if self.abandoned:
                return


class ThreadedCalls:
    """Timeout-bounded calls of blocking functions on reused daemon worker threads."""

    def __init__(self, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._abandoned: list[threading.Thread] = []
        self._idle: list[_Worker] = []
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
        """``fn(**kwargs)`` on a worker thread named ``thread_name`` while it runs;
        ``TimeoutError`` after ``timeout_s`` (the worker abandoned)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore belongs to one loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_workers), loop
        async with self._slots:
            future: asyncio.Future = loop.create_future()
            worker = self._idle.pop() if self._idle else _Worker()
            start = time.perf_counter()
            worker.jobs.put((fn, kwargs, loop, future, thread_name))
            try:
                value, raised = await asyncio.wait_for(future, timeout_s)
            except BaseException:
                if future.done() and not future.cancelled():  # it finished: still usable
                    self._idle.append(worker)
                else:  # hung, or the caller gave up: its thread leaves once the call returns
                    worker.abandoned = True
                    worker.jobs.put(None)  # ends it too if the call returned just now
                    self._abandoned.append(worker.thread)
                raise
            self._idle.append(worker)
        return CallOutcome(value, raised, time.perf_counter() - start)

    def close(self) -> None:
        """Let the idle workers' threads end (busy and abandoned ones end after their call)."""
        while self._idle:
            self._idle.pop().jobs.put(None)
