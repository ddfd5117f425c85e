"""Bounded over long runs: committed segments pruned, maps bounded, exactly-once kept."""

from __future__ import annotations

from buffer.arrow_batch import from_ipc
from buffer.bank import LEDGER_NAME, Snapshot, list_segments, read_ledger
from buffer.config import BufferConfig
from buffer.core import BufferCore
from buffer.retention import Retention
from buffer.synthetic import make_group

GROUP = 2


def _core(path, **cfg) -> BufferCore:
    return BufferCore(
        BufferConfig(**{"segment_rows": 4, "max_staleness": 100, **cfg}),
        bank_dir=path,
        groups_per_version=2,
        max_concurrent_groups=16,
    )


def _ids(batch) -> list[str]:
    return list(dict.fromkeys(from_ipc(batch.arrow_ipc).column("group_id").to_pylist()))


def _feed(core: BufferCore, start: int, count: int) -> None:
    for i in range(start, start + count):
        core.ingest(make_group(f"g{i}", GROUP))


def _take(core: BufferCore, n: int, watermark: int) -> list[str]:
    taken = core.take_batch(n, 0, received_watermark=watermark)
    assert taken is not None
    return _ids(taken[0])


def test_a_long_run_keeps_maps_and_bank_bounded(tmp_path):
    core = _core(tmp_path)
    trained: list[str] = []
    sizes = []
    for round_ in range(50):
        _feed(core, round_ * 4, 4)
        trained += _take(core, 2, len(trained))
        trained += _take(core, 2, len(trained))
        core.commit(len(trained) - 2)  # one batch late, as the driver commits
        stats = core.stats()
        sizes.append((stats["store_known_uids"], stats["bank_segments"], stats["tracked_handouts"]))
    assert trained == [f"g{i}" for i in range(200)]
    assert core.stats()["pruned_segments"] > 90
    # what is held is what is in flight (two uncommitted groups and their neighbours)
    assert max(s[0] for s in sizes[10:]) <= 4 * GROUP
    assert max(s[1] for s in sizes[10:]) <= 3
    assert max(s[2] for s in sizes[10:]) <= 2
    assert len(list_segments(tmp_path)) <= 3
    assert (tmp_path / LEDGER_NAME).stat().st_size < 2000


def test_reload_after_pruning_restores_counts_and_serves_nothing_twice(tmp_path):
    core = _core(tmp_path)
    _feed(core, 0, 12)
    trained = _take(core, 2, 0) + _take(core, 2, 2) + _take(core, 2, 4)
    core.commit(4)
    assert core.stats()["pruned_segments"] >= 1
    assert isinstance(read_ledger(tmp_path / LEDGER_NAME)[0], Snapshot)
    before = core.stats()
    # no close(): a kill -9; the learner then resumes from the checkpoint at watermark 4
    again = _core(tmp_path)
    after = again.stats()
    for key in ("accepted_groups", "ready_groups", "handout_count", "committed_watermark"):
        assert after[key] == before[key], key
    again.resume(version=0, watermark=4)
    rest = []
    while (taken := again.take_batch(2, 0)) is not None:
        rest += _ids(taken[0])
    assert trained[:4] + rest == [f"g{i}" for i in range(12)]  # each once, in order
    # a committed, pruned group re-sent is not accepted again
    assert again.ingest(make_group("g0", GROUP)) == 0


def test_retained_groups_stay_closed_until_no_checkpoint_names_them(tmp_path):
    core = _core(tmp_path)
    _feed(core, 0, 8)
    _take(core, 2, 0), _take(core, 2, 2)
    core.commit(4, retain_groups=["g3"])  # g3 listed unfinished in a resumable checkpoint
    # g0, g1 (segment 0) forgotten; g3 known whole, and g2 too (it shares g3's segment)
    assert core.group_status(["g0", "g1", "g2", "g3"]) == [0, 0, GROUP, GROUP]
    assert core.ingest(make_group("g3", GROUP)) == 0  # a regenerated g3 is dropped
    assert core.stats()["duplicates"] == GROUP
    reloaded = _core(tmp_path)  # the retained group survives a restart
    assert reloaded.group_status(["g3"]) == [GROUP]
    assert reloaded.ingest(make_group("g3", GROUP)) == 0
    assert reloaded.stats()["group_closed"] == GROUP  # known by id only after a prune
    _take(reloaded, 2, 4)
    reloaded.commit(6, retain_groups=[])
    assert reloaded.group_status(["g2", "g3"]) == [0, 0]


def test_refused_groups_are_forgotten_only_one_commit_later():
    retention = Retention()
    retention.note_samples(0, ["stale", "kept"])
    retention.note_done(["stale"])
    first = retention.plan(["kept"], retain=[], closed_below=1)
    assert first.delete_segments == [] and first.forget_groups == []  # not final yet
    retention.forget(first)
    second = retention.plan([], retain=[], closed_below=1)
    assert second.delete_segments == [0]
    assert second.forget_groups == ["kept", "stale"]


def test_a_crash_between_ledger_rewrite_and_deletion_serves_nothing_again(tmp_path, monkeypatch):
    core = _core(tmp_path)
    _feed(core, 0, 8)
    trained = _take(core, 2, 0) + _take(core, 2, 2)
    monkeypatch.setattr(core.bank, "delete_segments", lambda indices: None)  # "crash"
    core.commit(4)
    segments_left = len(list_segments(tmp_path))
    monkeypatch.undo()
    again = _core(tmp_path)
    assert again.stats()["reload_skipped_closed"] > 0
    rest = []
    while (taken := again.take_batch(2, 0, received_watermark=4 + len(rest))) is not None:
        rest += _ids(taken[0])
    assert trained + rest == [f"g{i}" for i in range(8)]
    again.commit(8)
    assert len(list_segments(tmp_path)) < segments_left


def test_disk_bound_applies_backpressure_only_while_a_batch_is_ready(tmp_path):
    core = _core(tmp_path, bank_max_bytes=1)
    core.ingest(make_group("g0", GROUP))
    assert not core.is_full  # one group ready < a batch (2): the learner must get to train
    core.ingest(make_group("g1", GROUP))
    assert core.is_full  # over the bound with a batch ready: producers wait
    _take(core, 2, 0)
    assert not core.is_full
    assert core.stats()["bank_over_bound"] == 1


def test_prune_committed_false_keeps_the_whole_bank(tmp_path):
    core = _core(tmp_path, prune_committed=False)
    _feed(core, 0, 8)
    _take(core, 2, 0), _take(core, 2, 2)
    core.commit(4)
    assert core.stats()["pruned_segments"] == 0
    assert len(list_segments(tmp_path)) == 4
    assert _core(tmp_path, prune_committed=False).stats()["handout_count"] == 4


def test_inspect_reads_a_pruned_bank(tmp_path):
    from buffer.inspect import summarize

    core = _core(tmp_path)
    _feed(core, 0, 8)
    _take(core, 2, 0), _take(core, 2, 2)
    core.commit(4)
    summary = summarize(tmp_path)
    assert summary["handouts"] == 4 and summary["committed_watermark"] == 4
    assert summary["pruned_segments"] == core.stats()["pruned_segments"] > 0
