"""GSM8K scoring: the last '#### N' in the final 300 characters, numbers normalised."""

from __future__ import annotations

import pytest

from rollout_fleet.rewards import compute_score
from rollout_fleet.rewards.gsm8k_lenient import CLIP_CHARS, extract_answer, normalize_number


def score(solution: str, truth: str, **kwargs) -> float:
    from rollout_fleet.rewards.gsm8k_lenient import compute_score as gsm8k_score

    return gsm8k_score(solution, truth, **kwargs)["score"]


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0),
        ("#### 8", "7", 0.0),
        ("She owes 5 dollars.\n#### -5", "-5", 1.0),
        ("#### -5", "5", 0.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### 3.0", "3", 1.0),
        ("#### 0.25", "0.3", 0.0),
        ("#### 1,234,567", "1234567", 1.0),
        ("#### 1234", "1,234", 1.0),
        ("#### $1,200", "1200", 1.0),
        ("####$ 12", "12", 1.0),
        ("#### 72.", "72", 1.0),
        ("First guess #### 10, no wait.\n#### 12", "12", 1.0),
        ("#### 12 then #### 10", "12", 0.0),
        ("The answer is 7.", "7", 0.0),
        ("", "7", 0.0),
        ("####", "7", 0.0),
        ("#### seven", "7", 0.0),
    ],
)
def test_strict_scoring(solution, truth, expected):
    assert score(solution, truth) == expected


def test_only_the_final_characters_are_searched():
    assert score("#### 7" + " filler" * 100, "7") == 0.0
    assert score("x" * 1000 + "#### 7", "7") == 1.0
    assert extract_answer("#### 5" + "y" * (CLIP_CHARS - 6)) == "5"
    assert extract_answer("#### 5" + "y" * (CLIP_CHARS - 5)) is None


def test_flexible_mode_takes_the_last_number_anywhere():
    assert score("so 3 + 4 is 7.", "7", method="flexible") == 1.0
    assert score("it costs $1,200 in total", "1200", method="flexible") == 1.0
    assert score("7 apples, then -2", "-2", method="flexible") == 1.0
    assert score("no digits", "7", method="flexible") == 0.0
    assert score("#### 7 and then 9", "7", method="flexible") == 0.0


def test_format_score_is_given_only_when_an_answer_was_found():
    assert score("#### 8", "7", format_score=0.1) == 0.1
    assert score("no answer", "7", format_score=0.1) == 0.0


def test_normalize_number_canonical_forms():
    assert normalize_number(" $1,234.500. ") == "1234.5"
    assert normalize_number("-0") == "0"
    assert normalize_number("007") == "7"
    assert normalize_number("abc") == "abc"


def test_registered_under_verl_name_with_metrics():
    result = compute_score("fleetrl/gsm8k-lenient", "#### 7", "7")
    assert result == {"score": 1.0, "acc": 1.0, "answer_found": 1.0}
    assert compute_score("fleetrl/gsm8k-lenient", "7", "7")["answer_found"] == 0.0
