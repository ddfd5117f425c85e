"""Scorer of the ``synth/calc`` task (arithmetic with the ``calculator`` environment).

It reads the decoded whole response (the policy's turns and the calculator's
replies, special tokens skipped): the answer is the number after the LAST
``####`` in it, normalised as ``gsm8k_lenient.normalize_number`` does
("1,234.0" -> "1234"). The calculator's replies never contain ``####``
(``rollout_fleet.multi_turn.calculator``), so only the policy can answer; a
tool result the policy did not restate after ``####`` scores nothing.
Score 1.0 when the answer equals the ground truth, else 0.0. Metrics: ``acc``,
``answer_found`` and ``calc_calls`` (the ``<calc>`` calls the policy wrote).
"""

from __future__ import annotations

import re
from typing import Any

from rollout_fleet.multi_turn.calculator import CALL_RE
from rollout_fleet.rewards.gsm8k_lenient import normalize_number

_ANSWER_RE = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)")


def extract_answer(solution_str: str) -> str | None:
    found = _ANSWER_RE.findall(solution_str)
    return normalize_number(found[-1]) if found else None


def compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    answer = extract_answer(solution_str)
    correct = answer is not None and answer == normalize_number(ground_truth)
    return {
        "score": float(correct),
        "acc": float(correct),
        "answer_found": float(answer is not None),
        "calc_calls": float(len(CALL_RE.findall(solution_str))),
    }
