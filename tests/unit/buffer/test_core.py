"""BufferCore: acknowledged = banked, reload after a crash, rewinds, commits and resume."""

from __future__ import annotations

import pytest

from buffer.arrow_batch import from_ipc
from buffer.config import BufferConfig
from buffer.core import BufferCore, BufferStateError
from buffer.synthetic import make_group
from buffer.wire import TRAJECTORY_HEADER, encode


def _core(tmp_path, **cfg) -> BufferCore:
    return BufferCore(
        BufferConfig(**{"segment_rows": 8, **cfg}),
        bank_dir=tmp_path,
        groups_per_version=2,
        max_concurrent_groups=16,
    )


def _groups(n, size=2, prefix="g", version=0):
    return [t for i in range(n) for t in make_group(f"{prefix}{i}", size, version=version)]


def _uids(batch):
    return from_ipc(batch.arrow_ipc).column("uid").to_pylist()


def test_reload_restores_ready_partial_and_handed_out_state(tmp_path):
    core = _core(tmp_path)
    core.ingest(_groups(4) + make_group("p", 3)[:2])
    first, _ = core.take_batch(1, 0)
    assert _uids(first) == ["g0/0", "g0/1"]
    stats_before = core.stats()
    # no close(): simulate a kill -9 (everything acknowledged is already flushed)
    again = _core(tmp_path)
    after = again.stats()
    for key in ("accepted_samples", "accepted_groups", "ready_groups", "partial_groups"):
        assert after[key] == stats_before[key], key
    assert after["handout_count"] == 1
    batch, _ = again.take_batch(3, 0)
    assert _uids(batch)[::2] == ["g1/0", "g2/0", "g3/0"]
    assert batch.handout_start == 1
    # the partial group completes from a resubmission; duplicates are dropped
    assert again.ingest(make_group("p", 3)) == 1
    assert again.stats()["duplicates"] == 2
    assert again.take_batch(1, 0)[0].handout_start == 4


def test_consumer_watermark_behind_handouts_serves_lost_batches_again_in_order(tmp_path):
    core = _core(tmp_path)
    core.ingest(_groups(6))
    b1, _ = core.take_batch(2, 0, received_watermark=0)
    core.take_batch(2, 0, received_watermark=2)  # this reply is "lost"
    again, _ = core.take_batch(2, 0, received_watermark=2)
    assert again.handout_start == 2
    assert _uids(again) == ["g2/0", "g2/1", "g3/0", "g3/1"]
    assert core.stats()["rewound_groups"] == 2
    with pytest.raises(BufferStateError, match="ahead"):
        core.take_batch(1, 0, received_watermark=99)


def test_resume_from_checkpoint_neither_loses_nor_repeats(tmp_path):
    core = _core(tmp_path)
    core.ingest(_groups(8))
    served = []
    for _ in range(3):
        batch, _ = core.take_batch(2, 0, received_watermark=len(served))
        served.extend(_uids(batch)[::2])
    core.commit(2)  # checkpoint after the first batch
    # learner crashes after training batch 3, restarts from the checkpoint (watermark 2)
    restarted = _core(tmp_path)
    restarted.resume(version=1, watermark=2)
    rest = []
    while (taken := restarted.take_batch(2, 1)) is not None:
        rest.extend(_uids(taken[0])[::2])
    trained = served[:2] + rest
    assert trained == [f"g{i}/0" for i in range(8)]  # each group exactly once, in order
    with pytest.raises(BufferStateError, match="committed"):
        restarted.resume(version=0, watermark=1)


def test_resume_resets_admission_counter_to_consumed_plus_waiting(tmp_path):
    core = _core(tmp_path)
    core.ingest(_groups(10))
    for w in range(0, 8, 2):
        core.take_batch(2, 0, received_watermark=w)
    assert core.admission_state().accepted_groups == 10
    # checkpoint at version 1 held watermark 2: 6 hand-outs re-served + 2 never handed out
    core.resume(version=1, watermark=2)
    state = core.admission_state()
    assert state.accepted_groups == 2 + 8  # consumed + waiting, not the 10 counted before
    assert state.policy_version == 1
    core.ingest(_groups(1, prefix="new"))
    # a buffer restart keeps the reset (the ledger holds the offset)
    assert _core(tmp_path).admission_state().accepted_groups == 11


def test_stale_refusals_survive_a_restart(tmp_path):
    core = _core(tmp_path, max_staleness=0)
    core.ingest(_groups(2, version=0) + _groups(2, prefix="h", version=1))
    core.publish_version(1)
    batch, _ = core.take_batch(2, learner_version=1)
    assert batch.refused_stale == 2
    again = _core(tmp_path, max_staleness=0).stats()
    assert again["refused_stale"] == 2
    assert again["accepted_groups"] == 2
    assert again["ready_groups"] == 0
    assert again["policy_version"] == 1


def test_bad_messages_are_counted_by_reason_and_good_ones_accepted(tmp_path):
    core = _core(tmp_path, max_message_bytes=4096)
    good = make_group("a", 1)[0]
    big = make_group("b", 1, response_len=2000)[0]
    messages = [
        [TRAJECTORY_HEADER, encode(good)],
        [b"XX\x01\x01", encode(good)],
        [b"FR\x09\x01", encode(good)],
        [TRAJECTORY_HEADER, b"\x93garbage"],
        [TRAJECTORY_HEADER],
        [TRAJECTORY_HEADER, encode(big)],
    ]
    assert core.ingest_messages(messages) == 1
    rejected = {k: v for k, v in core.stats().items() if k.startswith("rejected_frames.")}
    assert rejected == {
        "rejected_frames.bad_header": 1,
        "rejected_frames.wrong_schema": 1,
        "rejected_frames.malformed": 1,
        "rejected_frames.frame_count": 1,
        "rejected_frames.oversized": 1,
    }


def test_wrong_dtype_is_rejected_as_invalid(tmp_path):
    from buffer.wire import Array

    core = _core(tmp_path)
    t = make_group("a", 1)[0]
    t.response_ids = Array.of(t.response_ids.numpy(), "float32")
    assert core.ingest_messages([[TRAJECTORY_HEADER, encode(t)]]) == 0
    assert core.stats()["rejected_frames.invalid"] == 1


def test_publish_version_backwards_is_refused(tmp_path):
    core = _core(tmp_path)
    core.publish_version(3)
    with pytest.raises(BufferStateError, match="Resume"):
        core.publish_version(2)


def test_stats_report_every_counter_at_zero_before_anything_happens(tmp_path):
    from buffer.core import COUNTERS
    from buffer.store import REJECTION_REASONS, STORE_COUNTERS

    stats = _core(tmp_path).stats()
    for key in (*COUNTERS, *STORE_COUNTERS, *REJECTION_REASONS):
        assert stats[key] == 0, key
