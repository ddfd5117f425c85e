"""Preflight's reward trial: the user's reward function called on a few rows before Ray starts.

A function that imports and binds can still raise on every call (a typo in its body, a
field it expects in ``extra_info``, a return value that is not a score); in the run that
fails every sample, and the run learns nothing. Here it is called the way the rollout calls
it (``RewardRunner``: keywords, ``reward_kwargs``, batched or single, async or not, in a
worker thread under a timeout) on the first ``TRIAL_ROWS`` training rows it claims, each
with the row's own ground truth as the response. A call that raises or returns something
that is not a score refuses the run, quoting the error; a call that does not return within
``TRIAL_TIMEOUT_S`` (or ``rollout.reward_timeout_s``, if shorter) is a warning only: the
run's own timeout decides about slow functions.

Left out: functions that declare judge keywords (they score through the run's engines and
reward servers, which do not exist yet), and the value of the score (a ground truth given
as the response need not score 1 under every rule).
"""

from __future__ import annotations

import asyncio
from typing import Any

from launcher.config import RunConfig
from launcher.preflight_findings import Finding, shown

TRIAL_ROWS = 4
TRIAL_TIMEOUT_S = 10.0
TRIAL_FIX = (
    "fix the function: it must return a number, or a dict with 'score', for any response "
    "to any row it scores (every sample it raises on trains nothing)"
)


def trial_findings(cfg: RunConfig, reward: Any, samples: list[tuple[str, str, int, dict[str, Any]]]) -> list[Finding]:  # fmt: skip
    """Call ``reward`` (a loaded ``CustomReward``) on the first training rows it claims."""
    from rollout_fleet.rewards.runner import RewardRunner, claims

    custom = cfg.reward.custom_function
    rows = [
        (file, index, row)
        for key, file, index, row in samples
        if key == "data.train_files" and claims(custom.data_sources, row["data_source"])
    ][:TRIAL_ROWS]
    if not rows or reward.judge_keywords:
        return []
    timeout_s = min(cfg.rollout.reward_timeout_s, TRIAL_TIMEOUT_S)
    runner = RewardRunner(
        timeout_s, max_workers=len(rows), custom=reward, custom_sources=custom.data_sources,
        log_failures=False,
    )  # fmt: skip
    truths = [row["reward_model"]["ground_truth"] for _, _, row in rows]
    results = asyncio.run(
        runner.score_batch(
            [row["data_source"] for _, _, row in rows],
            truths,
            truths,
            [row["extra_info"] for _, _, row in rows],
        )
    )
    for (file, index, _), truth, result in zip(rows, truths, results, strict=True):
        if result.error is None:
            continue
        where = f"{shown(file)} row {index} (its ground truth {truth!r:.40} as the response)"
        if runner.num_timeouts and result.error.startswith("timed out"):
            return [Finding(key="reward.custom_function.path", problem=f"{reward.name} did not return within {timeout_s:g} s on {where}", fix=f"make it faster; in the run a call longer than rollout.reward_timeout_s={cfg.rollout.reward_timeout_s:g} fails its samples", fatal=False)]  # fmt: skip
        return [Finding(key="reward.custom_function.path", problem=f"{reward.name} failed on {where}: {result.error}", fix=TRIAL_FIX)]  # fmt: skip
    return []
