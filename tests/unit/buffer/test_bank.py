"""Rollout bank: round trip, rotation, torn tails of segments and ledger."""

from __future__ import annotations

import os

import pyarrow as pa

from buffer.bank import (
    LEDGER_NAME,
    CommitMark,
    Handout,
    RolloutBank,
    list_segments,
    read_ledger,
    read_segment,
)
from buffer.synthetic import make_group


def test_appended_trajectories_read_back_identically(tmp_path):
    bank = RolloutBank(tmp_path, segment_rows=100)
    trajs = make_group("a", 3, response_len=5) + make_group("b", 2)
    bank.append(trajs[:2])
    bank.append(trajs[2:])
    back = [t for _, batch in bank.iter_trajectories() for t in batch]
    assert [t.uid for t in back] == [t.uid for t in trajs]
    for mine, theirs in zip(trajs, back, strict=True):
        assert mine.response_ids.numpy().tolist() == theirs.response_ids.numpy().tolist()
        assert mine.token_versions.numpy().tolist() == theirs.token_versions.numpy().tolist()
        assert mine.reward_metrics == theirs.reward_metrics
        assert mine.timings == theirs.timings
        assert mine.score == theirs.score  # small integers survive float32


def test_segments_rotate_after_segment_rows_and_are_never_reopened(tmp_path):
    bank = RolloutBank(tmp_path, segment_rows=4)
    for i in range(5):
        bank.append(make_group(f"g{i}", 2))
    bank.close()
    names = [p.name for _, p in list_segments(tmp_path)]
    assert names == ["segment_000000.arrow", "segment_000001.arrow", "segment_000002.arrow"]
    reopened = RolloutBank(tmp_path, segment_rows=4)
    reopened.append(make_group("late", 1))
    assert [i for i, _ in list_segments(tmp_path)][-1] == 3
    total = sum(len(b) for _, b in reopened.iter_trajectories())
    assert total == 11


def test_torn_segment_tail_keeps_the_whole_batches_before_it(tmp_path):
    bank = RolloutBank(tmp_path, segment_rows=1000)
    bank.append(make_group("a", 2))
    bank.append(make_group("b", 2))
    path = list_segments(tmp_path)[0][1]
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a crash mid-write of the second batch
        f.truncate(size - 50)
    batches = list(read_segment(path))
    assert [b.num_rows for b in batches] == [2]
    assert isinstance(batches[0], pa.RecordBatch)


def test_torn_ledger_line_is_ignored_and_repaired_before_appending(tmp_path):
    bank = RolloutBank(tmp_path, segment_rows=10)
    bank.record(Handout(0, ["a"], 0))
    bank.record(CommitMark(1))
    bank.close()
    ledger = tmp_path / LEDGER_NAME
    with open(ledger, "ab") as f:
        f.write(b'{"type":"handout","start":1,"gro')  # torn by a kill -9
    assert len(read_ledger(ledger)) == 2
    again = RolloutBank(tmp_path, segment_rows=10)
    again.record(CommitMark(2))
    records = read_ledger(ledger)
    assert records[-1] == CommitMark(2) and len(records) == 3


def test_segment_rotation_fsyncs(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    bank = RolloutBank(tmp_path, segment_rows=2)
    bank.append(make_group("a", 1))
    assert synced == []  # flushed, not fsynced, below the rotation size
    bank.append(make_group("b", 1))
    assert len(synced) == 1


def test_a_failed_write_ends_its_segment_so_later_writes_stay_readable(tmp_path, monkeypatch):
    bank = RolloutBank(tmp_path, segment_rows=1000)
    bank.append(make_group("a", 2))
    file = bank._file
    real_flush = file.flush

    def torn_flush():  # half a message reaches the disk, then the disk fails
        file.write(b"\x00" * 24)
        real_flush()
        raise OSError("disk full")

    monkeypatch.setattr(file, "flush", torn_flush)
    try:
        bank.append(make_group("lost", 2))
        raise AssertionError("the failed write must raise")
    except OSError:
        pass
    bank.append(make_group("b", 2))  # acknowledged after the failure
    bank.close()
    uids = [
        t.uid
        for _, batch in RolloutBank(tmp_path, segment_rows=1000).iter_trajectories()
        for t in batch
    ]
    assert "a/0" in uids and "b/0" in uids and "b/1" in uids
