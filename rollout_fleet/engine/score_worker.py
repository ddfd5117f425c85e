"""The one thread that owns a reward model: it merges the requests waiting into forwards.

``ScoreWorker.submit(prompts)`` queues one request's token lists and returns a
``concurrent.futures.Future`` of their scores; the worker thread takes every request
waiting (up to ``max_running_requests`` items, always at least one request), scores them
together with ``ScoreRunner.score`` (sorted, padded forwards) and resolves each future with
its own rows. So a server busy with many small requests still runs few, full forwards, as
SGLang's scheduler batches the requests it holds. ``call(fn)`` runs ``fn`` on the same
thread between two rounds (a weight load never races a forward).

A forward that raises fails the requests of its round (their futures carry the error) and
the thread goes on; ``alive`` turns false only once ``stop`` ended it. Left out: priorities
(SGLang's ``priority`` field is accepted and ignored), preemption, streaming.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.engine.score_runner import ScoreRunner

log = get_logger(__name__)


@dataclass
class _Job:
    prompts: list[list[int]] | None  # None: a call
    future: Future
    fn: Callable[[], Any] | None = None
    queued_at: float = field(default_factory=time.monotonic)


class ScoreWorker:
    """Scores queued requests in merged forwards on one thread; see the module docstring."""

    def __init__(self, runner: ScoreRunner, *, max_running_requests: int, name: str) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.runner = runner
        self.max_running_requests = max_running_requests
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._running_items = 0
        self.requests = 0
        self.items = 0
        self.rounds = 0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-score", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def load(self) -> dict[str, int]:
        """Items waiting and running now (for ``/get_server_info``)."""
        with self._cond:
            waiting = sum(len(j.prompts or ()) for j in self._queue)
            return {"waiting_items": waiting, "running_items": self._running_items}

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._queue) or self._running_items > 0

    def submit(self, prompts: list[list[int]]) -> Future:
        """Queue one request's prompts; the future holds one score list per prompt."""
        return self._put(_Job(prompts=prompts, future=Future()))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the worker thread before the next round; the future holds its result."""
        return self._put(_Job(prompts=None, future=Future(), fn=fn))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail what waits, end the thread (a forward in progress finishes first)."""
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in pending:
            job.future.set_exception(RuntimeError("the reward engine is shutting down"))
        self._thread.join(timeout_s)

    def _put(self, job: _Job) -> Future:
        with self._cond:
            if self._stopping:
                job.future.set_exception(RuntimeError("the reward engine is shutting down"))
                return job.future
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def _take(self) -> list[_Job] | None:
        """The next round: one call alone, or every request waiting up to the item cap."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            if self._queue[0].fn is not None:
                return [self._queue.popleft()]
            round_: list[_Job] = []
            items = 0
            while self._queue and self._queue[0].fn is None:
                size = len(self._queue[0].prompts or ())
                if round_ and items + size > self.max_running_requests:
                    break
                round_.append(self._queue.popleft())
                items += size
            self._running_items = items
            return round_

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                if jobs[0].fn is not None:
                    self._run_call(jobs[0])
                else:
                    self._run_round(jobs)
            finally:
                with self._cond:
                    self._running_items = 0

    @staticmethod
    def _run_call(job: _Job) -> None:
        try:
            job.future.set_result(job.fn())  # type: ignore[misc]
        except Exception as err:  # handed to the caller, which answers the HTTP request
            job.future.set_exception(err)

    def _run_round(self, jobs: list[_Job]) -> None:
        prompts = [p for job in jobs for p in job.prompts or ()]
        try:
            scores = self.runner.score(prompts)
        except Exception as err:  # a failed forward fails its round, not the server
            log.exception("scoring %d items failed", len(prompts))
            for job in jobs:
                job.future.set_exception(err)
            return
        self.rounds += 1
        self.requests += len(jobs)
        self.items += len(prompts)
        start = 0
        for job in jobs:
            end = start + len(job.prompts or ())
            job.future.set_result(scores[start:end])
            start = end
