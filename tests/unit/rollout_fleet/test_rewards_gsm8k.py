"""GSM8K scoring is verl's, case for case: each expected value is what verl's
``verl/utils/reward_score/gsm8k.py`` returns (derived from its rule, and confirmed by
running verl's function on this table outside the repository)."""

from __future__ import annotations

import pytest

from rollout_fleet.rewards import compute_score
from rollout_fleet.rewards.gsm8k import CLIP_CHARS, extract_answer
from rollout_fleet.rewards.gsm8k import compute_score as gsm8k_score

# (solution, ground truth, verl's strict score)
STRICT_CASES = [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 72", "72", 1.0),
    ("#### 8", "7", 0.0),
    ("#### -5", "-5", 1.0),
    ("#### -5", "5", 0.0),
    ("She owes 5 dollars.\n#### -5", "-5", 1.0),
    ("####72", "72", 0.0),  # no space: no answer
    ("####  72", "72", 0.0),  # two spaces: no answer
    ("####\n72", "72", 0.0),
    ("####\t72", "72", 0.0),
    ("#### $72", "72", 0.0),
    ("#### 72 dollars", "72", 1.0),
    ("#### 72.00", "72", 0.0),
    ("#### 72.0", "72", 0.0),
    ("#### 72.", "72", 0.0),
    ("#### 72.", "72.", 1.0),
    ("#### 3.50", "3.5", 0.0),
    ("#### 3.5", "3.5", 1.0),
    ("#### .5", "0.5", 0.0),
    ("#### .5", ".5", 1.0),
    ("#### -0", "0", 0.0),
    ("#### 072", "72", 0.0),
    ("#### \uff17\uff12", "72", 0.0),  # full-width digits are not [0-9]
    ("#### 1,234", "1234", 1.0),
    ("#### 1,234", "1,234", 0.0),  # commas go from the answer, not from the truth
    ("#### 1234", "1,234", 0.0),
    ("#### 72", "72.0", 0.0),
    ("#### 72", " 72", 0.0),
    ("#### 72", "72 ", 0.0),
    ("#### ,72", "72", 1.0),
    ("#### 7,2", "72", 1.0),
    ("#### 1,234,567", "1234567", 1.0),
    ("#### 1.2.3", "1.2.3", 1.0),
    ("#### ...", "...", 1.0),
    ("#### .", "7", 0.0),
    ("#### --5", "-5", 0.0),
    ("#### +5", "5", 0.0),
    ("#### - 5", "-5", 0.0),
    ("#### -", "7", 0.0),
    ("##### 72", "72", 1.0),
    ("# ### 72", "72", 0.0),
    ("answer #### 72####9", "72", 1.0),  # the second marker has no space
    ("First guess #### 10, no wait.\n#### 12", "12", 1.0),
    ("#### 12 then #### 10", "12", 0.0),
    ("#### 12 then #### 10", "10", 1.0),
    ("#### 10,", "10", 1.0),
    ("#### 10,000", "10000", 1.0),
    ("#### 5e3", "5", 1.0),
    ("#### 5e3", "5000", 0.0),
    ("#### 1/2", "1", 1.0),
    ("#### 1/2", "0.5", 0.0),
    ("#### 7!", "7", 1.0),
    ("#### (7)", "7", 0.0),
    ("#### seven", "7", 0.0),
    ("The answer is 7.", "7", 0.0),
    ("", "7", 0.0),
    ("####", "7", 0.0),
    ("#### ", "7", 0.0),
    ("#### 7", "", 0.0),
    ("x" * 1000 + "#### 7", "7", 1.0),
    ("#### 7" + " filler" * 100, "7", 0.0),  # beyond the final 300 characters
    ("#### 5" + "y" * (CLIP_CHARS - 6), "5", 1.0),
    ("#### 5" + "y" * (CLIP_CHARS - 5), "5", 0.0),
    ("#### 12" + "y" * (CLIP_CHARS - 7), "12", 1.0),
    ("\u200b#### 72", "72", 1.0),
    ("#### 72\n\nThe answer is 72.", "72", 1.0),
    ("#### 0", "0", 1.0),
    ("#### 00", "0", 0.0),
]

# (solution, ground truth, verl's flexible score)
FLEXIBLE_CASES = [
    ("so 3 + 4 is 7", "7", 1.0),
    ("so 3 + 4 is 7.", "7", 0.0),  # "7." is the last run
    ("so 3 + 4 is 7.", "7.", 1.0),
    ("it costs $1,200 in total", "1200", 0.0),  # commas are kept in flexible mode
    ("it costs $1,200 in total", "1,200", 1.0),
    ("7 apples, then -2", "-2", 1.0),
    ("7 apples, then - 2", "2", 1.0),
    ("no digits", "7", 0.0),
    ("#### 7 and then 9", "7", 0.0),
    ("#### 7 and then 9", "9", 1.0),
    ("#### 7", "7", 1.0),
    ("####7", "7", 1.0),
    ("the answer is 7 .", "7", 1.0),  # a lone "." is skipped
    ("the answer is 7, ok", "7", 0.0),  # "7," is the last run
    ("the answer is 7, ok", "7,", 1.0),
    ("7 , ", "7", 0.0),  # a lone "," is an answer
    ("7 , ", ",", 1.0),
    (". . .", ".", 1.0),  # only "." runs: the answer is "."
    ("72.00", "72", 0.0),
    ("3.50", "3.5", 0.0),
    ("-0", "0", 0.0),
    ("072", "72", 0.0),
    ("\uff17\uff12", "72", 0.0),
    ("x" * 1000 + " 41", "41", 1.0),
    ("41 " + "x" * 400, "41", 0.0),
    ("a-b 5-3", "-3", 1.0),
    ("", "0", 0.0),
]


@pytest.mark.parametrize(("solution", "truth", "expected"), STRICT_CASES)
def test_strict_score_is_verls(solution, truth, expected):
    assert gsm8k_score(solution, truth)["score"] == expected
    assert compute_score("openai/gsm8k", solution, truth)["score"] == expected


@pytest.mark.parametrize(("solution", "truth", "expected"), FLEXIBLE_CASES)
def test_flexible_score_is_verls(solution, truth, expected):
    assert gsm8k_score(solution, truth, method="flexible")["score"] == expected


def test_format_score_is_given_only_when_an_answer_was_found():
    assert gsm8k_score("#### 8", "7", format_score=0.1)["score"] == 0.1
    assert gsm8k_score("no answer", "7", format_score=0.1)["score"] == 0.0
    assert gsm8k_score("#### 7", "7", score=2.0)["score"] == 2.0


def test_extracted_answers_and_extra_fields():
    assert extract_answer("#### 1,2,3") == "123"
    assert extract_answer("see 1,2,3", method="flexible") == "1,2,3"
    assert extract_answer("####72") is None
    with pytest.raises(ValueError, match="accepted: strict, flexible"):
        extract_answer("#### 7", method="loose")  # type: ignore[arg-type]
    assert compute_score("openai/gsm8k", "#### 7", "7") == {
        "score": 1.0,
        "acc": 1.0,
        "answer_found": 1.0,
    }
    assert compute_score("openai/gsm8k", "7", "7")["answer_found"] == 0.0


def test_tables_are_large_enough():
    assert len(STRICT_CASES) >= 60
