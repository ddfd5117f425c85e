"""verl Parquet schema: valid rows round-trip; every kind of bad row names file, row and field;
optional columns and plain-string prompts are accepted; a file's problems come all at once."""

from __future__ import annotations

import copy

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleetrl.data.schema import DatasetError, file_problems, read_rows, validate_row, write_rows

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
        (("prompt",), ["3+5="], "prompt[0]"),
        (("prompt",), [], "prompt"),
        (("prompt", 0, "role"), "narrator", "prompt[0].role"),
        (("prompt", 0, "content"), 5, "prompt[0].content"),
        (("reward_model", "ground_truth"), 8, "reward_model.ground_truth"),
        (("reward_model",), None, "reward_model"),
        (("extra_info",), "train", "extra_info"),
        (("ability",), 3, "ability"),
    ],
)
def test_bad_row_error_names_file_row_and_field(path, value, field):
    with pytest.raises(DatasetError) as info:
        validate_row(_with(path, value), file="data/train.parquet", index=7)
    err = info.value
    assert (err.file, err.row, err.field) == ("data/train.parquet", 7, field)
    assert str(err).startswith(f"dataset error in data/train.parquet: row 7: field {field!r}: ")


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


def test_extra_info_ability_and_their_fields_are_optional_and_read_with_defaults(tmp_path):
    rows = [
        {k: v for k, v in GOOD_ROW.items() if k not in ("ability", "extra_info")},
        _with(("extra_info",), {"note": "no split, no index"}),
        _with(("extra_info",), None),
    ]
    for index, row in enumerate(rows):
        validate_row(row, file="f.parquet", index=index)
    path = tmp_path / "minimal.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:1]), path)  # only the three required columns
    assert read_rows(path) == [{**rows[0], "ability": "", "extra_info": {}}]


def test_plain_string_prompts_are_written_and_read_back(tmp_path):
    rows = [_with(("prompt",), "3+5="), _with(("prompt",), "4+4=")]
    path = write_rows(rows, tmp_path / "plain.parquet")
    assert pq.read_schema(path).field("prompt").type == pa.string()
    assert [r["prompt"] for r in read_rows(path)] == ["3+5=", "4+4="]
    with pytest.raises(DatasetError, match="a mix of strings and message lists"):
        write_rows([GOOD_ROW, rows[0]], tmp_path / "mixed.parquet")


def test_file_problems_lists_every_problem_once_with_how_many_rows_share_it(tmp_path):
    rows = [_with(("prompt",), "3+5="), *[_with(("prompt",), "")] * 3]
    rows.append(_with(("reward_model",), None) | {"prompt": "1+1="})
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # as a foreign tool writes it
    problems, good = file_problems(path)
    assert [(p.row, p.field) for p in problems] == [(1, "prompt"), (4, "reward_model")]
    assert problems[0].problem.endswith("(and 2 more rows)")
    assert [r["prompt"] for r in good] == ["3+5="]
    wrong_type = tmp_path / "ints.parquet"
    pq.write_table(pa.Table.from_pylist([_with(("prompt",), 5)] * 2), wrong_type)
    (problem,), _ = file_problems(wrong_type)
    assert problem.field == "prompt" and "got int 5 (and 1 more rows)" in problem.problem
    missing = tmp_path / "missing.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "x"}]), missing)
    (problem,), _ = file_problems(missing)
    assert "missing column(s) data_source, reward_model" in str(problem)
