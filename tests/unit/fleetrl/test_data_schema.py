"""verl Parquet schema: valid rows round-trip; every kind of bad row names file, row and field."""

from __future__ import annotations

import copy

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleetrl.data.schema import DatasetError, read_rows, validate_row, write_rows

GOOD_ROW = {
    "data_source": "synth/add",
    "prompt": [{"role": "user", "content": "3+5="}],
    "ability": "synth",
    "reward_model": {"style": "rule", "ground_truth": "8"},
    "extra_info": {"split": "train", "index": 0},
}


def _with(path: tuple[str, ...], value):
    row = copy.deepcopy(GOOD_ROW)
    node = row
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return row


def test_written_rows_read_back_identically(tmp_path):
    rows = [GOOD_ROW, _with(("extra_info", "index"), 1)]
    path = write_rows(rows, tmp_path / "sub" / "train.parquet")
    assert read_rows(path) == rows


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("data_source",), "", "data_source"),
        (("data_source",), KeyError, "data_source"),
        (("prompt",), "", "prompt"),
        (("prompt",), 5, "prompt"),
        (("prompt",), [], "prompt"),
        (("prompt", 0, "role"), "narrator", "prompt[0].role"),
        (("prompt", 0, "content"), 5, "prompt[0].content"),
        (("reward_model", "ground_truth"), 8, "reward_model.ground_truth"),
        (("reward_model",), None, "reward_model"),
        (("extra_info", "split"), KeyError, "extra_info.split"),
        (("extra_info", "index"), "0", "extra_info.index"),
        (("ability",), None, "ability"),
    ],
)
def test_bad_row_error_names_file_row_and_field(path, value, field):
    with pytest.raises(DatasetError) as info:
        validate_row(_with(path, value), file="data/train.parquet", index=7)
    err = info.value
    assert (err.file, err.row, err.field) == ("data/train.parquet", 7, field)
    assert str(err).startswith(f"dataset error in data/train.parquet: row 7: field {field!r}: ")


def test_a_plain_string_prompt_is_a_prompt(tmp_path):
    rows = [_with(("prompt",), "3+5="), _with(("prompt",), "4+4=")]
    assert read_rows(write_rows(rows, tmp_path / "plain.parquet")) == rows


def test_bad_row_in_a_parquet_file_is_reported_with_its_row_index(tmp_path):
    rows = [GOOD_ROW, GOOD_ROW, _with(("reward_model", "ground_truth"), None)]
    # Write without validation, as a foreign tool would.
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(
        DatasetError, match=r"bad\.parquet: row 2: field 'reward_model.ground_truth'"
    ):
        read_rows(path)


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "no_prompt.parquet"
    table = pa.Table.from_pylist([{k: v for k, v in GOOD_ROW.items() if k != "prompt"}])
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match="missing column.*prompt") as info:
        read_rows(path)
    assert info.value.field == "prompt"


def test_missing_and_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="nope.parquet: file not found"):
        read_rows(tmp_path / "nope.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        read_rows(junk)
