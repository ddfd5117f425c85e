"""GSM8K conversion: verl's prompt, ground truth and extra_info from local jsonl/parquet files."""

from __future__ import annotations

import argparse
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleetrl.data import gsm8k
from fleetrl.data.schema import DatasetError, read_rows

RECORDS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "A car costs $12,500 less $500.", "answer": "12500-500=12000\n#### 12,000"},
    {"question": "It is 5 below zero, then 3 colder.", "answer": "-5-3=-8\n#### -8"},
]


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


# (answer text, the ground truth verl's examples/data_preprocess/gsm8k.py writes; None
# where its extract_solution stops on an assertion)
GROUND_TRUTH_CASES = [
    ("3+4=7\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### 12,000", "12000"),
    ("#### -8", "-8"),
    ("#### 2.5", "2.5"),
    ("a #### 1 b\n#### 1,234", "1"),  # the FIRST marker
    ("#### 5\n#### 6", "5"),
    ("#### 5 apples", "5"),
    ("#### 72.", "72."),
    ("#### .5", ".5"),
    ("#### ,72", "72"),
    ("#### 7,2", "72"),
    ("#### 1.2.3", "1.2.3"),
    ("#### 3.50", "3.50"),
    ("#### 072", "072"),
    ("#### $5", None),
    ("####5 then #### 6", "6"),
    ("####  5", None),
    ("####\n5", None),
    ("#### -", None),
    ("##### 9", "9"),
    ("no marker 5", None),
    ("#### seven", None),
    ("#### \uff15", None),
]


@pytest.mark.parametrize(("answer", "expected"), GROUND_TRUTH_CASES)
def test_ground_truth_is_verls_first_marker_rule(answer, expected):
    assert gsm8k.ground_truth_of(answer) == expected


def test_rows_verl_accepts_are_converted_with_verls_ground_truth(tmp_path):
    records = [
        {"question": "q1", "answer": "#### 5 apples"},
        {"question": "q2", "answer": "#### 72."},
        {"question": "q3", "answer": "#### .5"},
        {"question": "q4", "answer": "#### 3\n#### 4"},
    ]
    written = gsm8k.convert(_jsonl(tmp_path / "train.jsonl", records), tmp_path / "out")
    rows = pq.read_table(written["train"]).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "72.", ".5", "3"]


def test_folder_of_jsonl_converts_to_verl_rows(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _jsonl(raw / "train.jsonl", RECORDS)
    _jsonl(raw / "test.jsonl", RECORDS[:1])
    written = gsm8k.convert(raw, tmp_path / "out")
    assert written == {
        "train": tmp_path / "out/train.parquet",
        "test": tmp_path / "out/test.parquet",
    }

    rows = read_rows(written["train"])
    assert [r["reward_model"] for r in rows] == [
        {"style": "rule", "ground_truth": "7"},
        {"style": "rule", "ground_truth": "12000"},
        {"style": "rule", "ground_truth": "-8"},
    ]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["ability"] == "math"
    assert first["prompt"] == [
        {
            "role": "user",
            "content": RECORDS[0]["question"]
            + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert first["extra_info"] == {
        "split": "train",
        "index": 0,
        "answer": RECORDS[0]["answer"],
        "question": RECORDS[0]["question"],
    }
    assert [r["extra_info"]["split"] for r in read_rows(written["test"])] == ["test"]


def test_hf_layout_with_sharded_parquet_under_main_is_found(tmp_path):
    main = tmp_path / "gsm8k" / "main"
    main.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RECORDS[:2]), main / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[2:]), main / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[:1]), main / "test-00000-of-00001.parquet")
    written = gsm8k.convert(tmp_path / "gsm8k", tmp_path / "out")
    rows = read_rows(written["train"])
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert rows[2]["reward_model"]["ground_truth"] == "-8"


def test_single_file_converts_only_its_split(tmp_path):
    written = gsm8k.convert(_jsonl(tmp_path / "test.jsonl", RECORDS), tmp_path / "out")
    assert list(written) == ["test"]
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_bad_record_names_file_row_and_field(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    bad = [*RECORDS[:2], {"question": "q", "answer": "no final marker"}]
    _jsonl(raw / "train.jsonl", bad)
    _jsonl(raw / "test.jsonl", RECORDS)
    with pytest.raises(DatasetError) as info:
        gsm8k.convert(raw, tmp_path / "out")
    assert (info.value.file, info.value.row, info.value.field) == (
        str(raw / "train.jsonl"),
        2,
        "answer",
    )

    _jsonl(raw / "train.jsonl", [{"answer": "#### 1"}])
    with pytest.raises(DatasetError, match=r"train\.jsonl: row 0: field 'question'"):
        gsm8k.convert(raw, tmp_path / "out")


def test_missing_split_file_is_a_clear_error_and_the_cli_handler_exits_2(tmp_path, caplog):
    raw = tmp_path / "raw"
    raw.mkdir()
    _jsonl(raw / "train.jsonl", RECORDS)
    with pytest.raises(DatasetError, match="no test file found"):
        gsm8k.convert(raw, tmp_path / "out")
    status = gsm8k.main(argparse.Namespace(input=str(tmp_path / "absent"), out=str(tmp_path / "o")))
    assert status == 2
    assert "input not found" in caplog.text
