"""Rule scores: run the row's reward function off the event loop, with a timeout, never raising.

Which function scores a row: the custom one (``reward.custom_function``) when its
``data_sources`` claim the row's ``data_source`` (an exact name, or a prefix
ending in ``*``; none listed = every row), else the registry's built-in scorer
for the data source. ``score`` scores one sample (a single function), and
``score_batch`` the samples of one group in one call (a batched function; a
single function is then called once per sample, concurrently).

Whatever goes wrong — the function raises, runs past ``timeout_s``, returns a
non-finite number, something that is not a score or a list of the wrong length,
or the data source has no scorer — the result has ``error`` set (score 0.0, a
placeholder: the sample's reward *failed*, and it trains nothing), the matching
counter (``num_errors`` / ``num_timeouts``) goes up and a log line names the data
source and the cause. Callers can therefore await it inside a group without a
try block.

How a function runs: a plain one in its own daemon thread, at most
``max_workers`` at a time (``rollout_fleet.threaded_call`` says why threads and
not processes; a timed-out call is abandoned and ``num_hung`` counts its thread
until it returns); an ``async def`` one on the event loop, cancelled at the
timeout. ``reward_kwargs`` and the judge keywords the function declares
(rollout_fleet/rewards/judge.py) are passed with every call.

Left out: retries (a reward function is expected to be deterministic; one that
calls a server retries inside itself), process isolation for untrusted code.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from fleetrl.log import get_logger
from rollout_fleet.rewards.custom import CustomReward, describe
from rollout_fleet.rewards.judge import JudgeAccess
from rollout_fleet.rewards.registry import RewardRegistry, default_registry
from rollout_fleet.threaded_call import ThreadedCalls

log = get_logger(__name__)

_LOG_FIRST = 20  # failures logged one by one before thinning out
_LOG_EVERY = 1000  # then every this many


class RewardResult(msgspec.Struct, kw_only=True):
    score: float
    metrics: dict[str, float] = {}  # extra numeric values the scorer returned ("acc", ...)
    error: str | None = None  # why the reward failed (score is then a 0.0 placeholder)
    elapsed_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None


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


def _as_list(value: Any, expected: int) -> list[Any]:
    """A batched function's return value as a list of ``expected`` items (ValueError if not)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # numpy arrays and torch tensors
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"batched reward returned a {type(value).__name__}, not a list")
    if len(value) != expected:
        raise ValueError(f"batched reward returned {len(value)} scores for {expected} samples")
    return list(value)


def claims(patterns: Sequence[str], data_source: str) -> bool:
    """Whether ``data_source`` is one of ``patterns`` (``prefix*`` matches a prefix; none = all)."""
    if not patterns:
        return True
    return any(
        data_source.startswith(p[:-1]) if p.endswith("*") else data_source == p for p in patterns
    )


class RewardRunner:
    """Async, timeout-bounded, never-raising rule scoring (see the module docstring)."""

    def __init__(
        self,
        timeout_s: float,
        max_workers: int,
        custom: CustomReward | Callable[..., Any] | None = None,
        registry: RewardRegistry | None = None,
        *,
        custom_sources: Sequence[str] = (),
        judge: JudgeAccess | None = None,
        log_failures: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"reward max_workers must be >= 1, got {max_workers}")
        if custom is not None and not isinstance(custom, CustomReward):
            custom = describe(custom, getattr(custom, "__name__", repr(custom)), {})
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.custom = custom
        self.custom_sources = tuple(custom_sources)
        self.registry = registry or default_registry()
        self.judge = judge or JudgeAccess()
        self.log_failures = log_failures  # off where the caller reports failures itself
        self.num_scored = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self._calls = ThreadedCalls(max_workers)

    @property
    def num_hung(self) -> int:
        """Timed-out calls whose threads are still running."""
        return self._calls.num_hung

    def close(self) -> None:
        """End the idle worker threads (``ThreadedCalls.close``)."""
        self._calls.close()

    def uses_custom(self, data_source: str) -> bool:
        return self.custom is not None and claims(self.custom_sources, data_source)

    def has_scorer(self, data_source: str) -> bool:
        """Whether a rule scores ``data_source`` (the custom function or a built-in)."""
        if self.uses_custom(data_source):
            return True
        try:
            self.registry.resolve(data_source)
        except ValueError:
            return False
        return True

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Raise ``UnknownDataSourceError`` now if a dataset's source has no scorer."""
        for source in set(data_sources):
            if not self.uses_custom(source):
                self.registry.resolve(source)

    def stats(self) -> dict[str, float]:
        return {
            "reward/rule_calls": float(self.num_scored),
            "reward/rule_errors": float(self.num_errors),
            "reward/rule_timeouts": float(self.num_timeouts),
            "reward/rule_hung": float(self.num_hung),
        }

    async def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict[str, Any] | None = None,
    ) -> RewardResult:
        """Score one completion; ``error`` set on any failure (never raises)."""
        custom = self.custom if self.uses_custom(data_source) else None
        if custom is not None and custom.batched:
            row = (data_source, solution_str, ground_truth, extra_info)
            return (await self._batch_call(custom, [row]))[0]
        self.num_scored += 1
        if custom is not None:
            fn, judge, extra = custom.fn, custom.judge_keywords, custom.reward_kwargs
            is_async = custom.is_async
        else:
            try:
                fn = self.registry.resolve(data_source)
            except ValueError as err:
                return self._failed("errors", data_source, str(err), 0.0)
            judge, extra, is_async = frozenset(), {}, False
        kwargs = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
            **extra,
            **self.judge.kwargs(judge),
        }
        outcome = await self._call(fn, kwargs, is_async, data_source)
        if isinstance(outcome, RewardResult):
            return outcome
        value, elapsed = outcome
        try:
            return to_result(value, elapsed)
        except ValueError as err:
            return self._failed("errors", data_source, str(err), elapsed)

    async def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[RewardResult]:
        """Score a group's samples: one call of a batched custom function for the rows it
        claims, the single scorer of every other row concurrently; never raises."""
        rows = list(zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True))
        custom = self.custom
        in_batch = [
            custom is not None and custom.batched and self.uses_custom(row[0]) for row in rows
        ]
        singles = [i for i, batched in enumerate(in_batch) if not batched]
        batched = [i for i, batched in enumerate(in_batch) if batched]
        results: dict[int, RewardResult] = {}
        scored = await asyncio.gather(*(self.score(*rows[i]) for i in singles))
        results.update(zip(singles, scored, strict=True))
        if batched and custom is not None:
            scored = await self._batch_call(custom, [rows[i] for i in batched])
            results.update(zip(batched, scored, strict=True))
        return [results[i] for i in range(len(rows))]

    async def _batch_call(self, custom: CustomReward, rows: list[tuple]) -> list[RewardResult]:
        self.num_scored += len(rows)
        sources, texts, truths, extras = (list(column) for column in zip(*rows, strict=True))
        kwargs = {
            "data_sources": sources,
            "solution_strs": texts,
            "ground_truths": truths,
            "extra_infos": extras,
            **custom.reward_kwargs,
            **self.judge.kwargs(custom.judge_keywords),
        }
        where = sources[0] if len(set(sources)) == 1 else f"{len(set(sources))} sources"
        outcome = await self._call(custom.fn, kwargs, custom.is_async, where, count=len(rows))
        if isinstance(outcome, RewardResult):
            return [outcome] * len(rows)
        value, elapsed = outcome
        try:
            values = _as_list(value, len(rows))
        except ValueError as err:
            return [self._failed("errors", where, str(err), elapsed, count=len(rows))] * len(rows)
        out = []
        for source, item in zip(sources, values, strict=True):
            try:
                out.append(to_result(item, elapsed))
            except ValueError as err:
                out.append(self._failed("errors", source, str(err), elapsed))
        return out

    async def _call(
        self,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        is_async: bool,
        where: str,
        count: int = 1,
    ) -> tuple[Any, float] | RewardResult:
        """``(value, seconds)`` of one call, or the failed result (timeout, raised)."""
        start = time.perf_counter()
        if is_async:
            try:
                value = await asyncio.wait_for(fn(**kwargs), self.timeout_s)
            except TimeoutError:
                return self._timed_out(where, count)
            except Exception as err:  # user code: its failure fails its samples, reported
                elapsed = time.perf_counter() - start
                return self._failed("errors", where, f"raised {err!r}", elapsed, count)
            return value, time.perf_counter() - start
        try:
            outcome = await self._calls.call(fn, kwargs, self.timeout_s, f"reward-{where}")
        except TimeoutError:
            return self._timed_out(where, count)
        if outcome.raised is not None:
            error = f"raised {outcome.raised!r}"
            return self._failed("errors", where, error, outcome.elapsed_s, count)
        return outcome.value, outcome.elapsed_s

    def _timed_out(self, where: str, count: int) -> RewardResult:
        hung = f" ({self.num_hung} hung reward threads)" if self.num_hung else ""
        error = f"timed out after {self.timeout_s:g} s{hung}"
        return self._failed("timeouts", where, error, self.timeout_s, count)

    def _failed(
        self, kind: str, data_source: str, error: str, elapsed_s: float, count: int = 1
    ) -> RewardResult:
        if kind == "timeouts":
            self.num_timeouts += count
            total = self.num_timeouts
        else:
            self.num_errors += count
            total = self.num_errors
        first = total - count < _LOG_FIRST
        if self.log_failures and (first or total // _LOG_EVERY != (total - count) // _LOG_EVERY):
            log.warning(
                "reward for data_source %r failed (%d samples): %s (reward %s so far: %d)",
                data_source,
                count,
                error,
                kind,
                total,
            )
        return RewardResult(score=0.0, error=error, elapsed_s=elapsed_s)
