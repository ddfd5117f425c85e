"""MATH scorer, lenient: registered as ``fleetrl/math-lenient`` (the MATH sources use
verl's exact rule, ``rollout_fleet.rewards.math_answer``): the last ``\\boxed{...}``
of the solution against the ground truth.

Extraction: the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, so
``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; ``\\boxed 5`` gives ``5``. A
solution without one scores 0.

Equivalence (the "simple" rule of verl's hendrycks-math scorer, re-derived):
both sides are normalised — line breaks, ``\\!``, spaces, ``\\left``/``\\right``,
``^\\circ``, dollar signs, ``\\%`` and trailing units (``10\\text{ cm}``) are
dropped, ``\\text{X}`` unwraps to X, ``dfrac``/``tfrac`` become ``frac``,
``\\frac12`` becomes ``\\frac{1}{2}``, ``\\sqrt2`` becomes ``\\sqrt{2}``, a short
``x =`` prefix and a trailing full stop are removed, ``.5`` becomes ``0.5`` — and
compared as strings. Plain numbers (integers, decimals, ``a/b``,
``\\frac{a}{b}``, thousands separators) are also compared as exact rationals,
so "0.5", "1/2" and "\\frac12" are equal, as are "1,000" and "1000".

Left out: symbolic equivalence (sympy / math-verify: "2\\sqrt{2}" vs
"\\sqrt{8}"), intervals and sets in different orders, matrices.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_UNIT_RE = re.compile(r"^(?P<value>.+?)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][^{}]*\}$")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{(?P<inner>[^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\frac(?P<num>[0-9a-zA-Z])(?P<den>[0-9a-zA-Z])")
_FRAC_HALF_RE = re.compile(r"\\frac(?P<num>\{[^{}]*\})(?P<den>[0-9a-zA-Z])")
_SQRT_RE = re.compile(r"\\sqrt(?P<arg>[0-9a-zA-Z])")
_DECIMAL_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_INT_RATIO_RE = re.compile(r"(?P<num>-?\d+)/(?P<den>\d+)")
_FRAC_RE = re.compile(r"(?P<sign>-?)\\frac\{(?P<num>-?\d+)\}\{(?P<den>\d+)\}")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces), or None."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(command) :]
    if rest.startswith(" "):  # "\boxed 5": the argument runs to the next "$" or space
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the solution was cut off inside the box


def normalize(answer: str) -> str:
    """Canonical string of a MATH answer (see the module docstring for every rule)."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "").replace("$", "")
    text = text.strip()
    unit = _UNIT_RE.match(text)
    if unit:
        text = unit.group("value")
    text = _TEXT_RE.sub(lambda m: m.group("inner"), text)
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    parts = text.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        text = parts[1]
    text = text.replace(" ", "")
    text = _SQRT_RE.sub(r"\\sqrt{\g<arg>}", text)
    text = _FRAC_SHORT_RE.sub(r"\\frac{\g<num>}{\g<den>}", text)
    text = _FRAC_HALF_RE.sub(r"\\frac\g<num>{\g<den>}", text)
    text = text.rstrip(".")
    return text


def as_rational(text: str) -> Fraction | None:
    """The exact value of a normalised plain number (int, decimal, a/b, \\frac{a}{b}), else None."""
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    if _DECIMAL_RE.fullmatch(text):
        return Fraction(text)
    match = _INT_RATIO_RE.fullmatch(text) or _FRAC_RE.fullmatch(text)
    if match and int(match.group("den")) != 0:
        value = Fraction(int(match.group("num")), int(match.group("den")))
        return -value if match.groupdict().get("sign") == "-" else value
    return None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    left, right = normalize(answer), normalize(ground_truth)
    if left == right:
        return True
    left_value, right_value = as_rational(left), as_rational(right)
    return left_value is not None and left_value == right_value


def compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """1.0 if the last boxed answer is equivalent to ``ground_truth`` (itself unboxed if boxed)."""
    answer = last_boxed(solution_str)
    truth = last_boxed(ground_truth) or ground_truth
    correct = answer is not None and is_equivalent(answer, truth)
    return {
        "score": float(correct),
        "acc": float(correct),
        "answer_found": float(answer is not None),
    }
