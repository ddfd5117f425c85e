"""Rewards for rollouts: built-in rule scorers keyed by ``data_source`` (verl's names),
your own function from a file (single, batched or async; custom.py), reward-model
scores from servers (model_scorer.py), and the pipeline that combines them per group
and marks the samples whose reward failed (pipeline.py). Scoring never raises into
the rollout loop and never blocks it.

    from rollout_fleet.rewards import compute_score
    compute_score("openai/gsm8k", "... #### 72", "72")  # {"score": 1.0, "acc": 1.0, ...}
"""

from __future__ import annotations

from typing import Any

from rollout_fleet.rewards.custom import CustomReward, RewardLoadError, load_custom_reward
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
    "CustomReward",
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
