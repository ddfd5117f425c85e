"""MATH scorer with verl's rule, case for case (``verl/utils/reward_score/math_reward.py``,
itself the "simple" hendrycks-math rule of lm-evaluation-harness).

Registered for verl's MATH sources (``lighteval/MATH``,
``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``).

Extraction (``boxed_answer``):
- if ``"\\boxed "`` (with a space) occurs anywhere, the answer is the text after
  its LAST occurrence up to the next ``$`` (nothing stripped: ``\\boxed 5.``
  gives ``"5."``);
- otherwise the last ``\\boxed`` must be followed directly by ``{``; the answer
  is the text up to the brace that balances it. ``\\boxed`` not followed by
  ``{``, an unbalanced box, and ``\\fbox{...}`` (verl finds it but cannot
  unbox it) give no answer: score 0.

Equivalence (``is_equivalent``): both sides go through ``strip_string`` and are
compared as strings. The ground truth is NOT unboxed. ``strip_string``, in
order: drop line breaks and ``\\!``; ``\\\\`` -> ``\\``; ``tfrac``/``dfrac`` ->
``frac``; drop ``\\left``, ``\\right``, ``^{\\circ}``, ``^\\circ``, ``\\$``; cut at
``\\text{ `` (a unit; twice is an error); drop ``\\%``; `` .`` -> `` 0.`` and
``{.`` -> ``{0.``; a leading ``.`` gets a ``0``; ``k = v`` -> ``v`` when the left
side is at most 2 characters; ``\\sqrt3`` -> ``\\sqrt{3}``; drop spaces;
``\\frac12`` -> ``\\frac{1}{2}``; exactly ``0.5`` -> ``\\frac{1}{2}``; ``a/b`` of
two plain integers -> ``\\frac{a}{b}``. Plain ``$`` and ``%``, thousands
separators and trailing zeros are kept (``1,000`` != ``1000``, ``1.0`` != ``1``).
Where verl's normalisation raises (``\\text{ `` twice, ``\\sqrt`` or ``\\frac``
with nothing after it) the raw strings are compared.

A more forgiving scorer (exact rationals, ``\\fbox``, boxed ground truths) is
``rollout_fleet.rewards.math_lenient``, registered as ``fleetrl/math-lenient``.
"""

from __future__ import annotations

from typing import Any

_BOX_SPACE = "\\boxed "
_BOX_BRACE = "\\boxed{"
_UNIT = "\\text{ "


class _Unnormalizable(ValueError):
    """verl's normalisation raises on this text; it is compared raw instead."""


def boxed_answer(solution: str) -> str | None:
    """The answer of the solution's last box under verl's rule, or None."""
    if _BOX_SPACE in solution:
        return solution.split(_BOX_SPACE)[-1].split("$")[0]
    start = solution.rfind("\\boxed")
    if start < 0 or not solution.startswith(_BOX_BRACE, start):
        return None
    depth = 0
    for i in range(start + len(_BOX_BRACE) - 1, len(solution)):
        if solution[i] == "{":
            depth += 1
        elif solution[i] == "}":
            depth -= 1
            if depth == 0:
                return solution[start + len(_BOX_BRACE) : i]
    return None


def _remove_right_units(text: str) -> str:
    parts = text.split(_UNIT)
    if len(parts) > 2:
        raise _Unnormalizable(text)
    return parts[0]


def _fix_sqrt(text: str) -> str:
    head, *rest = text.split("\\sqrt")
    out = head
    for part in rest:
        if not part:
            raise _Unnormalizable(text)
        out += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return out


def _fix_fracs(text: str) -> str:
    head, *rest = text.split("\\frac")
    out = head
    for part in rest:
        if not part:
            raise _Unnormalizable(text)
        out += "\\frac"
        if part[0] == "{":
            out += part
        elif len(part) < 2:
            return text  # verl gives up on the whole string here
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _fix_a_slash_b(text: str) -> str:
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def strip_string(text: str) -> str:
    """verl's normalisation of a MATH answer (rules in the module docstring)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        text = text.replace(old, new)
    text = _remove_right_units(text)
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _fix_sqrt(text).replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """verl's ``is_equiv``: normalised strings equal (raw strings if normalisation fails)."""
    try:
        return strip_string(answer) == strip_string(ground_truth)
    except _Unnormalizable:
        return answer == ground_truth


def compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """1.0 if the last box's answer is equivalent to ``ground_truth``, else 0.0."""
    answer = boxed_answer(solution_str)
    correct = answer is not None and is_equivalent(answer, ground_truth)
    return {
        "score": float(correct),
        "acc": float(correct),
        "answer_found": float(answer is not None),
    }
