"""HH-RLHF conversion: shared turns become the prompt, last Assistant turns the responses."""

from __future__ import annotations

import gzip
import json

import pytest

from fleetrl.data import hh_rlhf
from fleetrl.data.preference import read_preference_rows
from fleetrl.data.schema import DatasetError
from launcher.cli import main as cli_main

SHARED = "\n\nHuman: What is 2+2?\n\nAssistant: Do you mean in base ten?\n\nHuman: Yes."
GOOD = {
    "chosen": SHARED + "\n\nAssistant: It is 4.",
    "rejected": SHARED + "\n\nAssistant: It is 5.",
}
ONE_TURN = {
    "chosen": "\n\nHuman: Hi\n\nAssistant: Hello! How can I help?",
    "rejected": "\n\nHuman: Hi\n\nAssistant: Go away.",
}
DROPPED = [
    {"chosen": "no turns at all", "rejected": "\n\nHuman: x\n\nAssistant: y"},  # malformed
    {
        "chosen": "\n\nHuman: x\n\nAssistant: y\n\nHuman: z",
        "rejected": "\n\nHuman: x\n\nAssistant: w",
    },  # malformed: ends with Human
    {
        "chosen": "\n\nHuman: a\n\nAssistant: b",
        "rejected": "\n\nHuman: c\n\nAssistant: b2",
    },  # prompt mismatch
    {
        "chosen": "\n\nHuman: a\n\nAssistant:",
        "rejected": "\n\nHuman: a\n\nAssistant: b",
    },  # empty response
    {
        "chosen": "\n\nHuman: a\n\nAssistant: b",
        "rejected": "\n\nHuman: a\n\nAssistant: b",
    },  # same response
]


def _write(path, records, compress: bool):
    text = "\n".join(json.dumps(r) for r in records) + "\n"
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text)
    return path


def test_shared_turns_become_chat_messages_and_last_turns_the_responses():
    row, reason = hh_rlhf.convert_pair(GOOD["chosen"], GOOD["rejected"])
    assert reason is None
    assert row == {
        "prompt": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Do you mean in base ten?"},
            {"role": "user", "content": "Yes."},
        ],
        "chosen": "It is 4.",
        "rejected": "It is 5.",
    }


@pytest.mark.parametrize(
    ("record", "reason"),
    list(
        zip(
            DROPPED,
            ["malformed", "malformed", "prompt_mismatch", "empty_response", "same_response"],
            strict=True,
        )
    ),
)
def test_unusable_pairs_are_dropped_with_their_reason(record, reason):
    assert hh_rlhf.convert_pair(record["chosen"], record["rejected"]) == (None, reason)


def test_a_folder_of_subsets_converts_per_split_with_counts(tmp_path, capsys):
    src = tmp_path / "hh"
    (src / "helpful-base").mkdir(parents=True)
    (src / "harmless-base").mkdir()
    _write(src / "harmless-base" / "train.jsonl.gz", [GOOD, *DROPPED], compress=True)
    _write(src / "helpful-base" / "train.jsonl.gz", [ONE_TURN], compress=True)
    _write(src / "helpful-base" / "test.jsonl", [ONE_TURN, GOOD], compress=False)
    (src / "red-team-attempts").mkdir()
    _write(
        src / "red-team-attempts" / "red_team_attempts.jsonl.gz",
        [{"transcript": "x"}],
        compress=True,
    )

    assert cli_main(["data", "hh-rlhf", "--input", str(src), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "train: kept 2 of 7 pairs (dropped: 2 malformed, 1 prompt_mismatch, 1 empty_response, 1 same_response)"
    )
    assert lines[1].startswith("test: kept 2 of 2 pairs (dropped: none)")
    train = read_preference_rows(tmp_path / "out" / "train.parquet")
    assert [r["chosen"] for r in train] == ["It is 4.", "Hello! How can I help?"]  # path order
    assert train[1]["prompt"] == [{"role": "user", "content": "Hi"}]
    assert len(read_preference_rows(tmp_path / "out" / "test.parquet")) == 2


def test_one_file_converts_its_split_and_bad_lines_name_file_and_line(tmp_path, capsys):
    good = _write(tmp_path / "test.jsonl.gz", [GOOD], compress=True)
    reports = hh_rlhf.convert(good, tmp_path / "out")
    assert [r.split for r in reports] == ["test"] and reports[0].kept == 1

    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({"chosen": 3, "rejected": "x"}) + "\n")
    with pytest.raises(
        DatasetError, match=r"train.jsonl: row 1: field 'chosen': expected a transcript"
    ):
        hh_rlhf.convert(bad, tmp_path / "out2")
    bad.write_text("{not json\n")
    assert cli_main(["data", "hh-rlhf", "--input", str(bad), "--out", str(tmp_path / "o3")]) == 2
    assert "row 0" in capsys.readouterr().err
    with pytest.raises(DatasetError, match="no train.jsonl"):
        hh_rlhf.convert(tmp_path / "out", tmp_path / "o4")
