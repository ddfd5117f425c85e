"""Score completions off the event loop, with a timeout, never raising to the caller.

``RewardRunner.score`` runs the reward function (the custom one if given, else
the registry's scorer for the ``data_source``) in a worker thread and awaits it
with ``timeout_s``. Whatever goes wrong — the function raises, runs past the
timeout, returns a non-finite number or something that is not a score, or the
data source has no scorer — the result is score 0.0 with ``error`` set, the
matching counter (``num_errors`` / ``num_timeouts``) goes up and a log line
names the data source and the cause. Rollout workers can therefore await it
inside a GRPO group without a try block.

Hang protection: each call runs in its own daemon thread, at most
``max_workers`` at a time; a timed-out call is abandoned and ``num_hung``
counts its thread until it returns (``rollout_fleet.threaded_call`` says why
threads and not processes).

Left out: batched scoring, reward models (a learned reward is a separate role).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import msgspec

from fleetrl.log import get_logger
from rollout_fleet.rewards.registry import RewardFn, RewardRegistry, default_registry
from rollout_fleet.threaded_call import ThreadedCalls

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
        self._calls = ThreadedCalls(max_workers)

    @property
    def num_hung(self) -> int:
        """Timed-out calls whose threads are still running."""
        return self._calls.num_hung

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
        kwargs = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        try:
            outcome = await self._calls.call(fn, kwargs, self.timeout_s, f"reward-{data_source}")
        except TimeoutError:
            return self._failed(
                "timeouts",
                data_source,
                f"timed out after {self.timeout_s:g} s ({self.num_hung} hung reward threads)",
                self.timeout_s,
            )
        if outcome.raised is not None:
            return self._failed(
                "errors", data_source, f"raised {outcome.raised!r}", outcome.elapsed_s
            )
        try:
            return to_result(outcome.value, outcome.elapsed_s)
        except ValueError as err:
            return self._failed("errors", data_source, str(err), outcome.elapsed_s)

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
