"""The synth/calc scorer: the number after the last #### of the whole response."""

from __future__ import annotations

import pytest

from rollout_fleet.rewards import compute_score
from rollout_fleet.rewards.synth_calc import extract_answer


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("#### 4045", "4045"),
        ("<calc>47*86+3</calc>tool\n4045\nassistant\n#### 4045", "4045"),
        ("#### 12 then #### 4,045.0", "4045"),
        ("####4045", "4045"),
        ("#### -3", "-3"),
        ("4045", None),  # a number without #### is no answer
        ("<calc>47*86+3</calc>tool\n4045\nassistant\n", None),  # the tool's value alone
        ("", None),
    ],
)
def test_answer_is_the_number_after_the_last_marker(response, answer):
    assert extract_answer(response) == answer


def test_registered_for_synth_calc_with_metrics_other_synth_tasks_keep_exact_match():
    right = compute_score("synth/calc", "<calc>2*3</calc>6 <calc>6+1</calc>7 #### 7", "7")
    assert right == {"score": 1.0, "acc": 1.0, "answer_found": 1.0, "calc_calls": 2.0}
    wrong = compute_score("synth/calc", "#### 8", "7")
    assert wrong["score"] == 0.0 and wrong["answer_found"] == 1.0
    assert compute_score("synth/add", "8", "8")["score"] == 1.0
    assert compute_score("synth/add", "#### 8", "8")["score"] == 0.0
