"""Reading a batched /classify reply: ``embedding[0]`` per item, in order; anything else (not
JSON, not a list, the wrong count, a missing score or one that is not a number) is a
ValueError naming it; a null score (SGLang's JSON for NaN and inf) is NaN for its item."""

from __future__ import annotations

import math

import pytest

from rollout_fleet.rewards.model_client import parse_classify_reply


def reply(*scores: str) -> bytes:
    return ("[" + ",".join(f'{{"embedding": [{s}], "meta_info": {{"id": "x"}}}}' for s in scores) + "]").encode()  # fmt: skip


def test_reads_the_first_value_of_each_embedding_in_order():
    assert parse_classify_reply(reply("0.5", "-2", "3e-3"), 3) == [0.5, -2.0, 0.003]
    two_labels = b'[{"embedding": [1.5, 9.0]}]'
    assert parse_classify_reply(two_labels, 1) == [1.5]


def test_a_null_score_is_nan_for_its_item_alone():
    scores = parse_classify_reply(reply("0.5", "null", "2"), 3)
    assert scores[0] == 0.5 and math.isnan(scores[1]) and scores[2] == 2.0


@pytest.mark.parametrize(
    ("raw", "expected", "message"),
    [
        (reply("NaN"), 1, "not readable JSON"),
        (reply("1", "1e999"), 2, "not readable JSON (Number out of range"),
        (reply("true"), 1, "item 0 has score True, not a number"),
        (reply('"0.3"'), 1, "item 0 has score '0.3', not a number"),
        (reply("1"), 2, "1 items for a batch of 2"),
        (b'{"embedding": [1.0]}', 1, "expected a list of 1 items, got dict"),
        (b'[{"meta_info": {}}]', 1, "item 0 has no embedding"),
        (b'[{"embedding": []}]', 1, "item 0 has no embedding"),
    ],
)
def test_a_bad_reply_is_refused_naming_what_is_wrong(raw, expected, message):
    with pytest.raises(ValueError) as caught:
        parse_classify_reply(raw, expected)
    assert str(caught.value).startswith(message)
