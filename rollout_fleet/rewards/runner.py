"""Score completions off the event loop, with a timeout, never raising to the caller.

``RewardRunner.score`` runs the reward function (the custom one if given, else
the registry's scorer for the ``data_source``) in a worker thread and awaits it
with ``timeout_s``. Whatever goes wrong — the function raises, runs past the
timeout, returns a non-finite number or something that is not a score, or the
data source has no scorer — the result is score 0.0 with ``error`` set, the
matching counter (``num_errors`` / ``num_timeouts``) goes up and a log line
names the data source and the cause. Rollout workers can therefore await it
inside a GRPO group without a try block.

Hang protection, and its trade-off: each call runs in its own daemon thread,
at most ``max_workers`` at a time. A timed-out call is abandoned: its slot is
freed at once (a hung function cannot block the loop or starve later calls),
but Python cannot kill a thread, so the hung thread keeps its CPU and memory
until it returns or the process exits (daemon threads never block exit).
``num_hung`` counts them. A process pool could kill hung work, but it needs
picklable functions and arguments and costs a process round trip per score;
reward functions here are short pure-Python checks, so threads win. Run
untrusted or heavy scorers (code execution) behind their own sandbox service.

Left out: batched scoring, reward models (a learned reward is a separate role).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from fleetrl.log import get_logger
from rollout_fleet.rewards.registry import RewardFn, RewardRegistry, default_registry

log = get_logger(__name__)

_LOG_FIRST = 20  # failures logged one by one before thinning out
_LOG_EVERY = 1000  # then every this many


class RewardResult(msgspec.Struct, kw_only=True):
    score: float
    metrics: dict[str, float] = {}  # extra numeric values the scorer returned ("acc", ...)
    error: str | None = None  # why the score is 0.0 when scoring failed
    elapsed_s: float = 0.0


def to_result(value: Any, elapsed_s: float = 0.0) -> RewardResult:
    """Turn a reward function's return value into a ``RewardResult``; ``ValueError`` if unusable."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key (keys: {', '.join(map(str, value))})")
        for key, item in value.items():
            # Non-numeric extras (e.g. the predicted answer text) are dropped: metrics travel as floats.
            if key != "score" and isinstance(item, (int, float)) and math.isfinite(item):
                metrics[str(key)] = float(item)
        value = value["score"]
    if value is None or isinstance(value, (str, bytes)):
        raise ValueError(f"reward is {value!r:.40}, not a number")
    try:
        score = float(value)  # int, bool, numpy and torch scalars
    except (TypeError, ValueError):
        raise ValueError(f"reward is a {type(value).__name__}, not a number") from None
    if not math.isfinite(score):
        raise ValueError(f"reward is not finite: {score}")
    return RewardResult(score=score, metrics=metrics, elapsed_s=elapsed_s)


def _deliver(future: asyncio.Future, outcome: tuple[Any, BaseException | None]) -> None:
    if not future.done():  # a timed-out call was already answered
        future.set_result(outcome)


def _run_in_thread(
    fn: RewardFn, kwargs: dict[str, Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future
) -> None:
    try:
        outcome: tuple[Any, BaseException | None] = (fn(**kwargs), None)
    except Exception as err:  # reported to the awaiting caller, counted and logged there
        outcome = (None, err)
    # RuntimeError: the loop closed while this (abandoned) call ran; nobody waits for it.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_deliver, future, outcome)


class RewardRunner:
    """Async, timeout-bounded, never-raising reward scoring (see the module docstring)."""

    def __init__(
        self,
        timeout_s: float,
        max_workers: int,
        custom_fn: RewardFn | None = None,
        registry: RewardRegistry | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"reward max_workers must be >= 1, got {max_workers}")
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.custom_fn = custom_fn
        self.registry = registry or default_registry()
        self.num_scored = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self._abandoned: list[threading.Thread] = []
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_hung(self) -> int:
        """Timed-out calls whose threads are still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Raise ``UnknownDataSourceError`` now if a dataset's source has no scorer."""
        if self.custom_fn is None:
            for source in set(data_sources):
                self.registry.resolve(source)

    def stats(self) -> dict[str, float]:
        return {
            "reward/num_scored": float(self.num_scored),
            "reward/num_errors": float(self.num_errors),
            "reward/num_timeouts": float(self.num_timeouts),
            "reward/num_hung": float(self.num_hung),
        }

    async def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None = None,
    ) -> RewardResult:
        """Score one completion; 0.0 with ``error`` set on any failure (never raises)."""
        self.num_scored += 1
        try:
            fn = self.custom_fn or self.registry.resolve(data_source)
        except ValueError as err:
            return self._failed("errors", data_source, str(err), 0.0)
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore belongs to one loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_workers), loop
        kwargs = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        async with self._slots:
            future: asyncio.Future = loop.create_future()
            thread = threading.Thread(
                target=_run_in_thread,
                args=(fn, kwargs, loop, future),
                name=f"reward-{data_source}",
                daemon=True,
            )
            start = time.perf_counter()
            thread.start()
            try:
                value, raised = await asyncio.wait_for(future, self.timeout_s)
            except TimeoutError:
                self._abandoned.append(thread)
                return self._failed(
                    "timeouts",
                    data_source,
                    f"timed out after {self.timeout_s:g} s ({self.num_hung} hung reward threads)",
                    time.perf_counter() - start,
                )
        elapsed = time.perf_counter() - start
        if raised is not None:
            return self._failed("errors", data_source, f"raised {raised!r}", elapsed)
        try:
            return to_result(value, elapsed)
        except ValueError as err:
            return self._failed("errors", data_source, str(err), elapsed)

    def _failed(self, kind: str, data_source: str, error: str, elapsed_s: float) -> RewardResult:
        if kind == "timeouts":
            self.num_timeouts += 1
            count = self.num_timeouts
        else:
            self.num_errors += 1
            count = self.num_errors
        if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
            log.warning(
                "reward for data_source %r scored 0: %s (reward %s so far: %d)",
                data_source,
                error,
                kind,
                count,
            )
        return RewardResult(score=0.0, error=error, elapsed_s=elapsed_s)
