"""A sample whose reward failed (``Trajectory.reward_error``) through the wire, the store,
the bank and ``inspect rollouts``.

It travels with its group (the group still completes and is handed out whole), the
mark survives msgpack, Arrow batches and bank segments, segments written before the
column existed reload as every reward scored, and the equal-score filter compares
only the scored samples.
"""

from __future__ import annotations

import io

import msgspec

from buffer.arrow_batch import SCHEMA, from_ipc, reward_error_column
from buffer.bank import RolloutBank
from buffer.config import BufferConfig
from buffer.core import BufferCore
from buffer.inspect import render, summarize
from buffer.store import GroupStore
from buffer.synthetic import make_group
from buffer.wire import Trajectory, decode_trajectory, encode
from tests.unit.buffer.test_arrow_loss_mask import write_segment_without

ERROR = "rule: raised ZeroDivisionError('boom')"


def failed(traj: Trajectory, error: str = ERROR) -> Trajectory:
    return msgspec.structs.replace(traj, reward_error=error, score=0.0)


def test_the_mark_survives_the_wire_and_an_old_producer_reads_as_scored():
    traj = failed(make_group("a", 2)[1])
    back = decode_trajectory(encode(traj))
    assert back.reward_error == ERROR and back.reward_failed
    # a message from a producer that predates the field: one element shorter
    fields = list(msgspec.msgpack.decode(encode(make_group("b", 1)[0])))
    old = msgspec.msgpack.encode(fields[:-1])
    assert decode_trajectory(old).reward_error == "" and not decode_trajectory(old).reward_failed


def test_a_group_with_a_failed_sample_completes_and_is_handed_out_whole(tmp_path):
    core = BufferCore(
        BufferConfig(max_staleness=4), bank_dir=tmp_path, groups_per_version=1,
        max_concurrent_groups=4,
    )  # fmt: skip
    group = make_group("g", 3)
    group[2] = failed(group[2])
    core.ingest(group)
    taken = core.take_batch(1, learner_version=0)
    assert taken is not None
    handed = from_ipc(taken[0].arrow_ipc)
    assert handed.num_rows == 3
    assert reward_error_column(handed) == ["", "", ERROR]


def test_a_bank_segment_written_before_the_column_reloads_as_every_reward_scored(tmp_path):
    trajs = make_group("old", 2, response_len=4)
    write_segment_without(tmp_path, trajs, "reward_error")
    back = [
        t for _, batch in RolloutBank(tmp_path, segment_rows=10).iter_trajectories() for t in batch
    ]
    assert back == trajs and all(not t.reward_failed for t in back)
    core = BufferCore(
        BufferConfig(max_staleness=4), bank_dir=tmp_path, groups_per_version=1,
        max_concurrent_groups=4,
    )  # fmt: skip
    taken = core.take_batch(1, learner_version=0)
    assert taken is not None
    handed = from_ipc(taken[0].arrow_ipc)
    assert handed.schema.names == SCHEMA.names
    assert reward_error_column(handed) == ["", ""]


def test_a_failed_sample_reloads_from_the_bank_with_its_mark(tmp_path):
    group = make_group("g", 2)
    group[0] = failed(group[0])
    bank = RolloutBank(tmp_path, segment_rows=10)
    bank.append(group)
    bank.close()
    back = [t for _, b in RolloutBank(tmp_path, segment_rows=10).iter_trajectories() for t in b]
    assert [t.reward_error for t in back] == [ERROR, ""]


def _closed(store: GroupStore, trajs: list[Trajectory]):
    outcomes = [store.add(t, i) for i, t in enumerate(trajs)]
    return [(c.group_id, c.kept, c.reason) for c in outcomes if c is not None]


def test_the_equal_score_filter_compares_the_scored_samples_only():
    store = GroupStore(max_staleness=1, capacity_groups=10, filter_equal_scores=True)
    # scored samples 1.0 and 1.0, the failed one's placeholder 0.0: zero advantage
    flat = make_group("flat", 3, score=1.0)
    flat[1] = failed(flat[1])
    varied = make_group("varied", 3)  # scores 0, 1, 2
    varied[0] = failed(varied[0])
    lonely = make_group("lonely", 2)  # one scored sample has nothing to compare with
    lonely[1] = failed(lonely[1])
    assert _closed(store, flat + varied + lonely) == [
        ("flat", False, "equal_scores"),
        ("varied", True, ""),
        ("lonely", False, "equal_scores"),
    ]


def test_a_group_left_with_no_scored_sample_is_dropped_and_counted():
    store = GroupStore(max_staleness=1, capacity_groups=10)
    gone = [failed(t) for t in make_group("gone", 2)]
    assert _closed(store, gone) == [("gone", False, "reward_failed")]
    assert store.counters["filtered_reward_failed"] == 1
    assert store.accepted_groups == 0


def test_inspect_counts_failed_samples_and_leaves_them_out_of_the_score(tmp_path):
    group = make_group("g", 3, score=1.0)
    group[1] = failed(group[1], "reward model: 2 scores for 3 inputs")
    bank = RolloutBank(tmp_path, segment_rows=10)
    bank.append(group)
    bank.close()
    summary = summarize(tmp_path)
    assert summary["reward_failed_samples"] == 1
    assert summary["reward_errors"] == {"reward model: 2 scores for 3 inputs": 1}
    assert summary["score"]["count"] == 2 and summary["score"]["mean"] == 1.0
    out = io.StringIO()
    render(summary, out)
    assert "reward failed            1 samples" in out.getvalue()
