"""Preference data: what the reward model reads, the Parquet schema's errors, drops, epochs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleetrl.data.pairs import PAIR_SCHEMA, PairCursor, PreferencePairs
from fleetrl.data.preference import read_preference_rows, write_preference_rows
from fleetrl.data.render import render_reward_input as reward_token_ids
from fleetrl.data.render import reward_text
from fleetrl.data.schema import DatasetError
from fleetrl.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_reward_input_renders_chat_then_response_and_ends_with_one_eos(tokenizer):
    ids = reward_token_ids(tokenizer, _chat("2+3="), "5")
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    )
    assert ids[-1] == tokenizer.eos_token_id
    # the policy's own end marker left in the response text is not closed twice
    assert reward_token_ids(tokenizer, _chat("2+3="), "5<|im_end|>") == ids
    # a plain prompt string: prompt, response, then EOS appended
    plain = reward_token_ids(tokenizer, "2+3=", "5")
    assert tokenizer.decode(plain) == "2+3=5<|im_end|>"
    assert reward_text(tokenizer, _chat("a"), "b", "off") == ("ab", False)


def _rows(n: int) -> list[dict]:
    return [{"prompt": _chat(f"{i}+1="), "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(n)]  # fmt: skip


def test_schema_round_trips_messages_strings_and_margin(tmp_path):
    path = write_preference_rows(
        [{"prompt": "q", "chosen": "a", "rejected": "b", "margin": 0.5},
         {"prompt": "r", "chosen": "c", "rejected": "d"}],
        tmp_path / "plain.parquet",
    )  # fmt: skip
    assert read_preference_rows(path) == [
        {"prompt": "q", "chosen": "a", "rejected": "b", "margin": 0.5},
        {"prompt": "r", "chosen": "c", "rejected": "d", "margin": 0.0},  # null margin reads as 0
    ]
    chat = write_preference_rows(_rows(2), tmp_path / "chat.parquet")
    assert pq.read_schema(chat).field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    assert read_preference_rows(chat)[1]["prompt"] == _chat("1+1=")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (pa.table({"prompt": ["q"], "chosen": ["a"]}), "missing column(s) rejected"),
        (pa.table({"prompt": ["q", "r"], "chosen": ["a", "b"], "rejected": ["c", None]}),
         "row 1: field 'rejected': expected a string, got NoneType"),
        (pa.table({"prompt": [1], "chosen": ["a"], "rejected": ["b"]}),
         "row 0: field 'prompt': expected a string or a list of messages, got int"),
        (pa.table({"prompt": [[{"role": "robot", "content": "x"}]], "chosen": ["a"], "rejected": ["b"]}),
         "row 0: field 'prompt[0].role': got 'robot'"),
        (pa.table({"prompt": ["q"], "chosen": ["a"], "rejected": ["b"], "margin": ["big"]}),
         "row 0: field 'margin': expected a finite number"),
    ],
)  # fmt: skip
def test_bad_files_fail_with_one_line_naming_file_row_and_field(tmp_path, table, message):
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError) as err:
        read_preference_rows(path)
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_pairs_drop_empty_identical_and_over_long_and_count_why(tmp_path, tokenizer):
    rows = _rows(3) + [
        {"prompt": _chat("9+1="), "chosen": " ", "rejected": "10"},  # empty
        {"prompt": _chat("   "), "chosen": "1", "rejected": "2"},  # empty prompt
        {"prompt": _chat("9+1="), "chosen": "10", "rejected": "10"},  # same response
        {"prompt": _chat("9+1="), "chosen": "10", "rejected": "1" * 40},  # over length
    ]
    pairs = PreferencePairs([write_preference_rows(rows, tmp_path / "p.parquet")], tokenizer, max_length=40)  # fmt: skip
    assert len(pairs) == 3 and pairs.num_rows == 7
    assert pairs.dropped == {"empty": 2, "same_response": 1, "over_length": 1}
    assert "kept 3 of 7" in pairs.summary() and "1 over_length" in pairs.summary()
    assert pairs.origin[2] == (str(tmp_path / "p.parquet"), 2)
    assert pairs.chosen(1).tolist() == reward_token_ids(tokenizer, _chat("1+1="), "2")
    assert pairs.rejected(1).tolist() == reward_token_ids(tokenizer, _chat("1+1="), "3")
    with pytest.raises(DatasetError, match="no preference pairs left: kept 0 of 3"):
        PreferencePairs([write_preference_rows(_rows(3), tmp_path / "q.parquet")], tokenizer, max_length=5)  # fmt: skip


def test_to_arrow_holds_the_pairs_token_ids_margins_and_indices(tmp_path, tokenizer):
    rows = [dict(r, margin=float(i)) for i, r in enumerate(_rows(4))]
    pairs = PreferencePairs([write_preference_rows(rows, tmp_path / "p.parquet")], tokenizer, max_length=64)  # fmt: skip
    batch = pairs.to_arrow([3, 1])
    assert batch.schema == PAIR_SCHEMA
    assert batch.column("chosen_ids").to_pylist() == [pairs.chosen(3).tolist(), pairs.chosen(1).tolist()]  # fmt: skip
    assert batch.column("rejected_ids").to_pylist()[0] == pairs.rejected(3).tolist()
    assert batch.column("margin").to_pylist() == [3.0, 1.0]
    assert batch.column("pair_index").to_pylist() == [3, 1]


def test_cursor_epochs_are_permutations_and_a_restored_cursor_continues_exactly():
    cursor = PairCursor(5, shuffle=True, seed=3)
    first = cursor.take(5)
    assert sorted(first.tolist()) == list(range(5))
    cursor.take(2)
    saved = cursor.state_dict()
    expected = cursor.take(6)  # crosses into epoch 2
    restored = PairCursor(5, shuffle=True, seed=3)
    restored.load_state_dict(saved)
    assert restored.take(6).tolist() == expected.tolist()
    assert PairCursor(4, shuffle=False, seed=0).take(6).tolist() == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="num_pairs=5 but the data now has num_pairs=4"):
        PairCursor(4, shuffle=True, seed=3).load_state_dict(saved)
    assert not np.array_equal(PairCursor(50, shuffle=True, seed=1).take(50), np.arange(50))
