"""The rule of the CPU RLHF demo's preference set (``data.synth_task: add2_even``): the
labeler prefers an even answer.

A reward function with verl's signature, so it plugs in wherever a user's does:
``fleetrl rm eval --rule configs/rules/even_answer.py`` (does the reward model rank a
policy's samples as this rule does?) and a run's ``reward.custom_function.path`` (to judge
an RL run by the rule, never by the reward model it trained on).

Score: 1.0 when the response, cut at its end-of-turn marker and stripped, is a
non-negative whole number (ASCII digits) that is even; 0.0 otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from rollout_fleet.rewards.synth import final_text

_NUMBER = re.compile(r"[0-9]+")


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    text = final_text(solution_str)
    return float(bool(_NUMBER.fullmatch(text)) and int(text) % 2 == 0)
