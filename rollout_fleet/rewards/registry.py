"""Which scorer grades which ``data_source``: a registry with verl's names built in.

A reward function has verl's custom-reward signature and is called with keywords::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None)
        -> float | dict   # a dict holds "score" plus extra numeric metrics ("acc", ...)

Built in, each returning what verl's ``default_compute_score`` returns for the
same source (as ``"score"``, with extra metrics): "openai/gsm8k" (verl's strict
``#### N`` rule), the MATH sources "lighteval/MATH",
"DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500" (verl's
hendrycks-math rule on the last ``\\boxed{}``); and, under names of our own,
"fleetrl/gsm8k-lenient" and "fleetrl/math-lenient" (numbers normalised, exact
rationals), "synth/*" (the synthetic tasks' exact match) and "synth/calc"
(the answer after the last ``####``, for the multi-turn calculator task). A key
ending in ``*`` matches every source with that prefix; an exact key wins over
a prefix, and a longer prefix over a shorter one.

Left out: verl's other built-ins (math_dapo's "Answer:" format, code sandboxes,
geo3k, search-R1); register them with ``RewardRegistry.register``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.rewards import (
    gsm8k,
    gsm8k_lenient,
    math_answer,
    math_lenient,
    synth,
    synth_calc,
)

log = get_logger(__name__)

RewardFn = Callable[[str, str, str, "dict[str, Any] | None"], "float | dict[str, Any]"]

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
GSM8K_LENIENT_SOURCE = "fleetrl/gsm8k-lenient"
MATH_LENIENT_SOURCE = "fleetrl/math-lenient"
SYNTH_PATTERN = "synth/*"
SYNTH_CALC_SOURCE = "synth/calc"


class UnknownDataSourceError(ValueError):
    """No reward function is registered for a ``data_source``."""


def _gsm8k(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
    return gsm8k.compute_score(solution_str, ground_truth)


def _math(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
    return math_answer.compute_score(solution_str, ground_truth)


def _gsm8k_lenient(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
    return gsm8k_lenient.compute_score(solution_str, ground_truth)


def _math_lenient(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
    return math_lenient.compute_score(solution_str, ground_truth)


def _synth(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
    return synth.compute_score(solution_str, ground_truth)


def _synth_calc(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
    return synth_calc.compute_score(solution_str, ground_truth)


class RewardRegistry:
    """data_source (or ``prefix*`` pattern) -> reward function."""

    def __init__(self) -> None:
        self._exact: dict[str, RewardFn] = {}
        self._prefix: dict[str, RewardFn] = {}

    def register(self, data_source: str, fn: RewardFn) -> None:
        """Map ``data_source`` (or ``prefix*``) to ``fn``, replacing any earlier entry."""
        if not data_source:
            raise ValueError("data_source to register must be a non-empty string")
        if not callable(fn):
            raise TypeError(f"reward for {data_source!r} must be callable, got {type(fn).__name__}")
        table = self._prefix if data_source.endswith("*") else self._exact
        key = data_source.removesuffix("*") if data_source.endswith("*") else data_source
        if key in table:
            log.info("reward for %r replaced by %s", data_source, getattr(fn, "__name__", fn))
        table[key] = fn

    def sources(self) -> list[str]:
        return sorted(self._exact) + sorted(f"{p}*" for p in self._prefix)

    def resolve(self, data_source: str) -> RewardFn:
        """The reward function of ``data_source``; ``UnknownDataSourceError`` if none."""
        if data_source in self._exact:
            return self._exact[data_source]
        prefixes = [p for p in self._prefix if data_source.startswith(p)]
        if prefixes:
            return self._prefix[max(prefixes, key=len)]
        raise UnknownDataSourceError(
            f"no reward function for data_source {data_source!r}; registered: "
            f"{', '.join(self.sources())} (or set a custom reward function)"
        )

    def compute_score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None = None,
    ) -> float | dict[str, Any]:
        fn = self.resolve(data_source)
        return fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )


def default_registry() -> RewardRegistry:
    """A fresh registry holding the built-in scorers."""
    registry = RewardRegistry()
    for source in GSM8K_SOURCES:
        registry.register(source, _gsm8k)
    for source in MATH_SOURCES:
        registry.register(source, _math)
    registry.register(GSM8K_LENIENT_SOURCE, _gsm8k_lenient)
    registry.register(MATH_LENIENT_SOURCE, _math_lenient)
    registry.register(SYNTH_PATTERN, _synth)
    registry.register(SYNTH_CALC_SOURCE, _synth_calc)
    return registry
