"""Reward functions for rollouts: built-in scorers keyed by ``data_source`` (verl's
names), custom functions loaded from a file, and an async runner that scores off
the event loop with a timeout and never raises.

    from rollout_fleet.rewards import compute_score
    compute_score("openai/gsm8k", "... #### 72", "72")  # {"score": 1.0, "acc": 1.0, ...}
"""

from __future__ import annotations

from typing import Any

from rollout_fleet.rewards.custom import RewardLoadError, load_custom_reward
from rollout_fleet.rewards.registry import (
    RewardFn,
    RewardRegistry,
    UnknownDataSourceError,
    default_registry,
)
from rollout_fleet.rewards.runner import RewardResult, RewardRunner

DEFAULT_REGISTRY = default_registry()


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
) -> float | dict[str, Any]:
    """Score with the built-in scorer of ``data_source`` (``UnknownDataSourceError`` if none)."""
    return DEFAULT_REGISTRY.compute_score(data_source, solution_str, ground_truth, extra_info)


__all__ = [
    "DEFAULT_REGISTRY",
    "RewardFn",
    "RewardLoadError",
    "RewardRegistry",
    "RewardResult",
    "RewardRunner",
    "UnknownDataSourceError",
    "compute_score",
    "default_registry",
    "load_custom_reward",
]
