"""The multi-turn loss mask through the wire, Arrow batches, IPC bytes and bank segments.

A batch or bank segment written before the ``loss_mask`` column existed must still
read (every token trained); an unmasked trajectory must round-trip unchanged.
"""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest

from buffer.arrow_batch import (
    SCHEMA,
    arrow_to_trajectories,
    from_ipc,
    loss_mask_column,
    to_ipc,
    trajectories_to_arrow,
)
from buffer.bank import BANK_SCHEMA, RolloutBank, segment_name, to_bank_batch
from buffer.config import BufferConfig
from buffer.core import BufferCore
from buffer.synthetic import make_group, make_trajectory
from buffer.wire import Array, WireError, decode_trajectory, encode

TOOL_MASK = [1, 1, 0, 0, 0, 1, 1, 0]  # policy, tool reply, policy, then a trailing tool reply


def masked_group(group_id: str) -> list:
    return [
        make_trajectory(group_id, 0, 3, loss_mask=TOOL_MASK),
        make_trajectory(group_id, 1, 3),  # unmasked: None on the wire
        make_trajectory(group_id, 2, 3, loss_mask=[0] * 8),  # tool tokens only
    ]


def without_loss_mask(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The same batch as a writer from before the column existed would have made it."""
    keep = [name for name in batch.schema.names if name != "loss_mask"]
    return pa.RecordBatch.from_arrays(
        [batch.column(name) for name in keep],
        schema=pa.schema([batch.schema.field(n) for n in keep]),
    )


def test_unmasked_trajectories_round_trip_unchanged_through_bank_batches():
    trajs = make_group("a", 3, response_len=5) + make_group("b", 2, response_len=0)
    back = arrow_to_trajectories(to_bank_batch(trajs))
    assert back == trajs
    assert all(t.loss_mask is None for t in back)


def test_masks_round_trip_and_every_row_has_the_column():
    trajs = masked_group("g")
    batch = trajectories_to_arrow(trajs)
    assert batch.schema.field("loss_mask").type == pa.list_(pa.uint8())
    assert batch.column("loss_mask").to_pylist() == [TOOL_MASK, [1] * 8, [0] * 8]
    back = arrow_to_trajectories(from_ipc(to_ipc(batch)))
    assert back[0].loss_mask.numpy().tolist() == TOOL_MASK
    assert back[0].loss_mask.dtype == "uint8"
    assert back[1].loss_mask is None
    assert back[2].loss_mask.numpy().tolist() == [0] * 8
    for t in back:
        t.validate()
    # the convention of the rollout side: a tool token's behaviour logprob is 0.0
    assert back[0].behavior_logprobs.numpy()[2:5].tolist() == [0.0, 0.0, 0.0]


def test_an_explicit_all_ones_mask_reads_back_as_the_default_none():
    traj = make_trajectory("g", 0, 1, loss_mask=[1] * 8)
    (back,) = arrow_to_trajectories(trajectories_to_arrow([traj]))
    assert back.loss_mask is None
    assert back == msgspec.structs.replace(traj, loss_mask=None, reward_metrics={}, timings={})


def test_a_batch_written_without_the_column_reads_as_all_ones():
    old = without_loss_mask(trajectories_to_arrow(make_group("a", 2, response_len=6)))
    assert "loss_mask" not in old.schema.names
    old = from_ipc(to_ipc(old))  # IPC bytes from a producer that predates the column
    assert loss_mask_column(old).tolist() == [1] * 12
    assert [t.loss_mask for t in arrow_to_trajectories(old)] == [None, None]


def write_segment_without(folder, trajs: list, column: str) -> None:
    """Segment 0 of a bank in ``folder`` as a writer from before ``column`` existed made it."""
    old_schema = pa.schema([f for f in BANK_SCHEMA if f.name != column])
    full = to_bank_batch(trajs)
    old_batch = pa.RecordBatch.from_arrays(
        [full.column(f.name) for f in old_schema], schema=old_schema
    )
    with open(folder / segment_name(0), "wb") as f, pa.ipc.new_stream(f, old_schema) as w:
        w.write_batch(old_batch)


def test_a_bank_segment_written_before_the_column_reloads_and_is_handed_out(tmp_path):
    trajs = make_group("old", 2, response_len=4)
    write_segment_without(tmp_path, trajs, "loss_mask")
    back = [
        t for _, batch in RolloutBank(tmp_path, segment_rows=10).iter_trajectories() for t in batch
    ]
    assert back == trajs
    core = BufferCore(
        BufferConfig(max_staleness=4), bank_dir=tmp_path, groups_per_version=1,
        max_concurrent_groups=4,
    )  # fmt: skip
    taken = core.take_batch(1, learner_version=0)
    assert taken is not None
    handed = from_ipc(taken[0].arrow_ipc)
    assert handed.schema.names == SCHEMA.names
    assert handed.column("loss_mask").to_pylist() == [[1] * 4, [1] * 4]


def test_a_wrong_length_or_non_binary_mask_is_refused_at_decode():
    good = make_trajectory("g", 0, 1, response_len=4, loss_mask=[1, 0, 1, 1])
    assert decode_trajectory(encode(good)).loss_mask.numpy().tolist() == [1, 0, 1, 1]
    short = msgspec.structs.replace(good, loss_mask=Array.of([1, 0, 1], "uint8"))
    with pytest.raises(WireError, match="loss_mask"):
        decode_trajectory(encode(short))
    wide = msgspec.structs.replace(good, loss_mask=Array.of([1, 0, 1, 1], "int32"))
    with pytest.raises(WireError, match="loss_mask"):
        decode_trajectory(encode(wide))
    two = msgspec.structs.replace(good, loss_mask=Array.of([1, 2, 1, 1], "uint8"))
    with pytest.raises(WireError, match="0/1"):
        decode_trajectory(encode(two))


def test_a_batch_whose_mask_rows_do_not_match_the_responses_is_refused():
    batch = trajectories_to_arrow(make_group("a", 2, response_len=3))
    rows = pa.array([[1, 1, 1], [1, 0]], pa.list_(pa.uint8()))  # row 1 one entry short
    bad = batch.set_column(batch.schema.get_field_index("loss_mask"), "loss_mask", rows)
    with pytest.raises(WireError, match="row 1: loss_mask has 2 entries for 3"):
        arrow_to_trajectories(bad)
    threes = pa.array([[1, 1, 1], [1, 3, 1]], pa.list_(pa.uint8()))
    bad = batch.set_column(batch.schema.get_field_index("loss_mask"), "loss_mask", threes)
    with pytest.raises(WireError, match="0/1"):
        loss_mask_column(bad)
