"""MATH scoring: last balanced \\boxed{...}, normalised and compared (strings or exact rationals)."""

from __future__ import annotations

import pytest

from rollout_fleet.rewards import compute_score
from rollout_fleet.rewards.math_lenient import is_equivalent, last_boxed, normalize


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so \boxed{5}", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b}}} and more", r"\sqrt{\frac{a}{b}}"),
        (r"\boxed{1} wait, \boxed{2}", "2"),
        (r"\boxed 7$", "7"),
        (r"\fbox{x^{2}}", "x^{2}"),
        (r"\boxed{\frac{1}{2}", None),  # cut off inside the box
        ("no box at all", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed_with_balanced_braces(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        ("1/2", r"\tfrac{1}{2}"),
        (".5", "0.5"),
        (r"\left( 3, 4 \right)", "(3,4)"),
        (r"10\text{ cm}", "10"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"\$5", "5"),
        ("1,000", "1000"),
        ("x = 5", "5"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"50\%", "50"),
        ("7.", "7"),
        (r"\text{(A)}", "(A)"),
        (r"-\frac{3}{4}", "-0.75"),
        (r"3\!\cdot\!2", r"3\cdot2"),
    ],
)
def test_equivalent_forms(answer, truth):
    assert is_equivalent(answer, truth), (normalize(answer), normalize(truth))


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("0.5", r"\frac{1}{3}"),
        ("2", "-2"),
        (r"\sqrt{2}", r"\sqrt{3}"),
        ("(3,4)", "(4,3)"),
        ("1/0", "0"),
    ],
)
def test_different_answers_are_not_equivalent(answer, truth):
    assert not is_equivalent(answer, truth)


@pytest.mark.parametrize("source", ["fleetrl/math-lenient"])
def test_lenient_source_scores_the_last_box(source):
    solution = r"First \boxed{3}. Actually the answer is $\boxed{\dfrac{1}{2}}$."
    assert compute_score(source, solution, r"\frac{1}{2}")["score"] == 1.0
    assert compute_score(source, solution, r"\boxed{0.5}")["score"] == 1.0  # boxed truth unboxed
    assert compute_score(source, solution, "3")["score"] == 0.0
    assert compute_score(source, "the answer is 1/2", "1/2") == {
        "score": 0.0,
        "acc": 0.0,
        "answer_found": 0.0,
    }
