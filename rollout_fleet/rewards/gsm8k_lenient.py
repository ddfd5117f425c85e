"""GSM8K scorer, lenient: registered as ``fleetrl/gsm8k-lenient`` (``openai/gsm8k``
is verl's exact rule, ``rollout_fleet.rewards.gsm8k``).

strict (default): the answer is the number after the LAST ``####`` within the
final ``CLIP_CHARS`` characters of the solution (verl clips the same way, so a
long chain of thought cannot be searched for a lucky number). ``$`` and spaces
may sit between ``####`` and the number.
flexible: the last number anywhere in those final characters.

Both sides go through ``normalize_number``: thousands separators, ``$`` and a
trailing full stop are removed, and a decimal is written canonically
("72.00" -> "72", "-0" -> "0", "3.50" -> "3.5"); the strings are then compared
exactly. Answers that are not numbers are compared as stripped text.

Left out: units ("5 dollars" scores under flexible only), fractions, words.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

CLIP_CHARS = 300
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_FLEXIBLE_RE = re.compile(_NUMBER)


def normalize_number(text: str) -> str:
    """Canonical text of a number ("$1,234.50." -> "1234.5"); other text only stripped."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return cleaned
    if not value.is_finite():
        return cleaned
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(
    solution_str: str, method: Literal["strict", "flexible"] = "strict"
) -> str | None:
    """The normalised final answer of a solution, or None if it gives none."""
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(tail)
    elif method == "flexible":
        found = _FLEXIBLE_RE.findall(tail)
    else:
        raise ValueError(f"gsm8k scoring method {method!r}; accepted: strict, flexible")
    return normalize_number(found[-1]) if found else None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Any]:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an
    answer was given but is wrong, 0.0 if none was found."""
    answer = extract_answer(solution_str, method)
    correct = answer is not None and answer == normalize_number(ground_truth)
    value = score if correct else (format_score if answer is not None else 0.0)
    return {"score": value, "acc": float(correct), "answer_found": float(answer is not None)}
