"""GSM8K scorer with verl's rule, case for case (``verl/utils/reward_score/gsm8k.py``).

Registered for ``openai/gsm8k`` so a GSM8K curve here reads like one from verl.

Only the final ``CLIP_CHARS`` characters of the solution are searched.
strict (default, what verl's ``default_compute_score`` uses): every match of
``"#### "`` (exactly one space) followed by a run of digits, ``.`` and ``,``
(optionally led by one ``-``); the LAST match, commas removed, is the answer.
``####72``, ``#### $72``, ``####  72`` and ``####\\n72`` give no answer.
flexible: every run of ``-?[0-9.,]+`` anywhere; the last one that is not ``"."``
is the answer, commas kept (if every run is ``"."``, the answer is ``"."``).

The answer is compared with the ground truth as TEXT, with no normalisation on
either side: ``72.00``, ``072`` and ``-0`` do not equal ``72``/``0``, and a
ground truth written ``1,234`` never matches a strict answer. Score: ``score``
(1.0) if equal, ``format_score`` (0.0) if an answer was found but differs, 0.0
if none was found. The returned dict adds ``acc`` and ``answer_found``.

A scorer that normalises numbers is ``rollout_fleet.rewards.gsm8k_lenient``,
registered under its own name (``fleetrl/gsm8k-lenient``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE_RE = re.compile(r"-?[0-9.,]+")
_NOT_AN_ANSWER = ("", ".")


def extract_answer(
    solution_str: str, method: Literal["strict", "flexible"] = "strict"
) -> str | None:
    """The answer text of a solution under verl's rule, or None if it gives none."""
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(tail)
        return found[-1].replace(",", "") if found else None
    if method == "flexible":
        found = _FLEXIBLE_RE.findall(tail)
        if not found:
            return None
        # verl walks the runs from the end and stops at the first real number; a
        # text made only of "." runs leaves its loop variable on the first run.
        return next((run for run in reversed(found) if run not in _NOT_AN_ANSWER), found[0])
    raise ValueError(f"gsm8k scoring method {method!r}; accepted: strict, flexible")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Any]:
    """verl's GSM8K score as ``{"score", "acc", "answer_found"}``."""
    answer = extract_answer(solution_str, method)
    correct = answer is not None and answer == ground_truth
    value = score if correct else (format_score if answer is not None else 0.0)
    return {
        "score": float(value),
        "acc": float(correct),
        "answer_found": float(answer is not None),
    }
