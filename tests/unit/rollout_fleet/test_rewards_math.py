"""MATH scoring is verl's, case for case: each expected value is what verl's
``verl/utils/reward_score/math_reward.py`` returns (derived from its rule, and confirmed
by running verl's function on this table outside the repository)."""

from __future__ import annotations

import pytest

from rollout_fleet.rewards import compute_score
from rollout_fleet.rewards.math_answer import boxed_answer, strip_string
from rollout_fleet.rewards.math_answer import compute_score as math_score

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")

# (solution, ground truth, verl's score)
CASES = [
    (r"so \boxed{5}", "5", 1.0),
    (r"so \boxed{5}", "6", 0.0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\tfrac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{\frac12}", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", "0.5", 1.0),
    (r"\boxed{.5}", "0.5", 1.0),
    (r"\boxed{0.50}", "0.5", 0.0),
    (r"\boxed{2/4}", r"\frac{1}{2}", 0.0),
    (r"\boxed{-1/2}", r"\frac{-1}{2}", 1.0),
    (r"\boxed{-1/2}", r"-\frac{1}{2}", 0.0),
    (r"\boxed{1,000}", "1000", 0.0),
    (r"\boxed{1,000}", "1,000", 1.0),
    (r"\boxed{1.0}", "1", 0.0),
    (r"\boxed{01}", "1", 0.0),
    (r"\fbox{5}", "5", 0.0),  # verl finds \fbox but cannot unbox it
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 0.0),
    (r"\boxed{\left( 3, 4 \right)}", "(3,4)", 1.0),
    (r"\boxed{(3,4)}", "(4,3)", 0.0),
    (r"\boxed{10\text{ cm}}", "10", 1.0),
    (r"\boxed{10\text{cm}}", "10", 0.0),
    (r"\boxed{10 \text{ cm} \text{ m}}", r"10 \text{ cm} \text{ m}", 1.0),  # raw compare
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{90^{\circ}}", "90", 1.0),
    (r"\boxed{\$5}", "5", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{50%}", "50", 0.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{x=5}", "5", 1.0),
    (r"\boxed{xy = 5}", "5", 0.0),
    (r"\boxed{x = y = 5}", "5", 0.0),
    (r"\boxed{7.}", "7", 0.0),
    (r"\boxed{3\!\cdot\!2}", r"3\cdot2", 1.0),
    (r"\boxed{a \\ b}", r"a \ b", 1.0),
    (r"\boxed{\text{(A)}}", "(A)", 0.0),
    (r"\boxed{\text{(A)}}", r"\text{(A)}", 1.0),
    (r"\boxed{1} wait, \boxed{2}", "2", 1.0),
    (r"\boxed{1} wait, \boxed{2}", "1", 0.0),
    (r"\boxed 7$", "7", 1.0),
    (r"\boxed 7", "7", 1.0),
    (r"\boxed 7.", "7", 0.0),
    (r"$\boxed 7$ and then \boxed{8}", "7", 1.0),  # a "\boxed " anywhere wins
    (r"\boxed {7}", "7", 0.0),
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # cut off inside the box
    ("no box at all", "5", 0.0),
    (r"\boxed", "5", 0.0),
    (r"\boxed5", "5", 0.0),
    (r"\boxed{}", "", 1.0),
    (r"\boxed{5}", r"\boxed{5}", 0.0),  # the ground truth is not unboxed
    (r"\boxed{\frac}", r"\frac", 1.0),  # normalisation fails: raw compare
    (r"\boxed{\sqrt}", "x", 0.0),
    (r"\boxed{\frac1}", r"\frac1", 1.0),
    (r"\boxed{\frac1{72}}", r"\frac{1}{72}", 1.0),
    (r"\boxed{\sqrt 2}", r"\sqrt{}2", 1.0),
    (r"\boxed{\sqrt 2}", r"\sqrt{2}", 0.0),
    (r"\boxed{ 5 }", "5", 1.0),
    (r"\boxed{5}", "5\n", 1.0),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", 1.0),
    (r"\boxed{x^{2}+1}", "x^2+1", 0.0),
    (r"\boxed{+5}", "5", 0.0),
    (r"\boxed{1_0/2}", r"\frac{10}{2}", 0.0),
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\boxed{\infty}", r"\infty", 1.0),
]


@pytest.mark.parametrize(("solution", "truth", "expected"), CASES)
def test_score_is_verls(solution, truth, expected):
    assert math_score(solution, truth)["score"] == expected
    for source in MATH_SOURCES:
        assert compute_score(source, solution, truth)["score"] == expected


def test_boxed_answer_and_normalisation():
    assert boxed_answer(r"\boxed{\sqrt{\frac{a}{b}}} and more") == r"\sqrt{\frac{a}{b}}"
    assert boxed_answer(r"\boxed 5.$ x") == "5."
    assert boxed_answer(r"\fbox{5}") is None
    assert strip_string("0.5") == r"\frac{1}{2}"
    assert strip_string(r"\frac12") == r"\frac{1}{2}"
    assert strip_string(".5") == r"\frac{1}{2}"
    assert compute_score("lighteval/MATH", "the answer is 1/2", "1/2") == {
        "score": 0.0,
        "acc": 0.0,
        "answer_found": 0.0,
    }


def test_table_is_large_enough():
    assert len(CASES) >= 60
