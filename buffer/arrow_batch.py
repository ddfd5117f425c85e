"""Trajectories <-> Arrow record batches: the batch format handed to the learner.

A batch is one ``pyarrow.RecordBatch`` whose token columns are ``list<int32>`` /
``list<float32>``; the learner reads ``.values`` and ``.offsets`` as numpy
views, so no per-token Python object is ever made. Over a socket a batch
travels as Arrow IPC stream bytes (``to_ipc`` / ``from_ipc``).

``loss_mask`` (``list<uint8>``, one entry per response token, 1 = the policy's own
token, 0 = a tool's or environment's reply inside a multi-turn response) is
written for every row, all ones when the trajectory's mask is None. It is the
one optional column: batches and bank segments written before it existed read
as all ones (``loss_mask_column``), and an all-ones row reads back as None, so
an unmasked trajectory round-trips unchanged.

``reward_error`` (string, "" = the reward was scored) marks a sample whose reward
failed: it travels with its group, and the learner trains nothing on it
(learner/batching.py). Optional like ``loss_mask``: batches and bank segments
written before it existed read as every reward scored (``reward_error_column``).
``episode`` (string, "" = not an agent rollout) names the agent episode a row is a
branch of; optional the same way (``episode_column``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from buffer.wire import Array, Trajectory, WireError

SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("group_id", pa.string()),
        ("group_size", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("token_versions", pa.list_(pa.int32())),
        ("score", pa.float32()),
        ("finish_reason", pa.string()),
        ("data_source", pa.string()),
        ("engine_id", pa.string()),
        ("prompt_index", pa.int64()),
        ("temperature", pa.float32()),
        ("loss_mask", pa.list_(pa.uint8())),
        ("reward_error", pa.string()),
        ("episode", pa.string()),
    ]
)
# Columns a reader may find missing (written before they existed); each has a default.
OPTIONAL_COLUMNS = frozenset({"loss_mask", "reward_error", "episode"})
REQUIRED_COLUMNS = tuple(name for name in SCHEMA.names if name not in OPTIONAL_COLUMNS)


# numpy's dtype of each list column's values (pyarrow's to_pandas_dtype() would import pandas:
# about a second of a busy process's first hand-in)
_NUMPY_DTYPES = {pa.int32(): np.int32, pa.float32(): np.float32, pa.uint8(): np.uint8}


def _list_column(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(values.astype(_NUMPY_DTYPES[value_type], copy=False))
    )


def trajectories_to_arrow(trajs: Sequence[Trajectory]) -> pa.RecordBatch:
    """Pack trajectories into one record batch with ``SCHEMA`` (order preserved)."""
    cols = {
        "uid": pa.array([t.uid for t in trajs], pa.string()),
        "group_id": pa.array([t.group_id for t in trajs], pa.string()),
        "group_size": pa.array([t.group_size for t in trajs], pa.int32()),
        "prompt_ids": _list_column([t.prompt_ids.numpy() for t in trajs], pa.int32()),
        "response_ids": _list_column([t.response_ids.numpy() for t in trajs], pa.int32()),
        "behavior_logprobs": _list_column(
            [t.behavior_logprobs.numpy() for t in trajs], pa.float32()
        ),
        "token_versions": _list_column([t.token_versions.numpy() for t in trajs], pa.int32()),
        "score": pa.array([t.score for t in trajs], pa.float32()),
        "finish_reason": pa.array([t.finish_reason for t in trajs], pa.string()),
        "data_source": pa.array([t.data_source for t in trajs], pa.string()),
        "engine_id": pa.array([t.engine_id for t in trajs], pa.string()),
        "prompt_index": pa.array([t.prompt_index for t in trajs], pa.int64()),
        "temperature": pa.array([t.temperature for t in trajs], pa.float32()),
        "loss_mask": _list_column([_loss_mask(t) for t in trajs], pa.uint8()),
        "reward_error": pa.array([t.reward_error for t in trajs], pa.string()),
        "episode": pa.array([t.episode for t in trajs], pa.string()),
    }
    return pa.RecordBatch.from_pydict(cols, schema=SCHEMA)


def _loss_mask(traj: Trajectory) -> np.ndarray:
    if traj.loss_mask is None:
        return np.ones(len(traj.response_ids), dtype=np.uint8)
    return traj.loss_mask.numpy()


def list_column_numpy(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column as numpy, zero-copy where Arrow allows."""
    col = batch.column(name)
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    if offsets[0] != 0:  # a sliced batch: rebase
        values = values[offsets[0] : offsets[-1]]
        offsets = offsets - offsets[0]
    return values, offsets


def loss_mask_column(batch: pa.RecordBatch) -> np.ndarray:
    """The flat uint8 loss mask, aligned with ``response_ids`` (all ones if the column is absent).

    Raises WireError when a row's mask length differs from its response's, or a
    value is not 0/1.
    """
    responses, response_offsets = list_column_numpy(batch, "response_ids")
    if "loss_mask" not in batch.schema.names:
        return np.ones(len(responses), dtype=np.uint8)
    mask, mask_offsets = list_column_numpy(batch, "loss_mask")
    if not np.array_equal(mask_offsets, response_offsets):
        row = int(np.argmax(np.diff(mask_offsets) != np.diff(response_offsets)))
        raise WireError(
            f"row {row}: loss_mask has {int(mask_offsets[row + 1] - mask_offsets[row])} entries"
            f" for {int(response_offsets[row + 1] - response_offsets[row])} response tokens"
        )
    mask = mask.astype(np.uint8, copy=False)
    if int(mask.max(initial=0)) > 1:
        raise WireError("loss_mask holds values other than 0/1")
    return mask


def reward_error_column(batch: pa.RecordBatch) -> list[str]:
    """Per row, why its reward failed ("" = scored; every row scored if the column is absent)."""
    if "reward_error" not in batch.schema.names:
        return [""] * batch.num_rows
    return [error or "" for error in batch.column("reward_error").to_pylist()]


def episode_column(batch: pa.RecordBatch) -> list[str]:
    """Per row, the agent episode it came from ("" for a batch written without the column)."""
    if "episode" not in batch.schema.names:
        return [""] * batch.num_rows
    return [episode or "" for episode in batch.column("episode").to_pylist()]


def to_ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes | memoryview) -> pa.RecordBatch:
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    batches = list(reader)
    if len(batches) != 1:
        return pa.Table.from_batches(batches, schema=reader.schema).combine_chunks().to_batches()[0]
    return batches[0]


def arrow_to_trajectories(batch: pa.RecordBatch) -> list[Trajectory]:
    """Inverse of ``trajectories_to_arrow`` (also reads the bank's extra map columns).

    ``score`` and ``temperature`` come back as float32-rounded values: the precision the
    learner sees anyway. ``loss_mask`` comes back None for a row that trains every token
    (or a batch written without the column), ``reward_error`` "" for a batch written
    without its column. Raises WireError for a malformed mask.
    """

    def lists(name: str, dtype: str) -> list[Array]:
        values, offsets = list_column_numpy(batch, name)
        return [Array.of(values[offsets[i] : offsets[i + 1]], dtype) for i in range(batch.num_rows)]

    cols = {name: batch.column(name).to_pylist() for name in _SCALAR_COLUMNS}
    prompt_ids = lists("prompt_ids", "int32")
    response_ids = lists("response_ids", "int32")
    logprobs = lists("behavior_logprobs", "float32")
    versions = lists("token_versions", "int32")
    _, response_offsets = list_column_numpy(batch, "response_ids")
    masks = _row_masks(loss_mask_column(batch), response_offsets)
    names = set(batch.schema.names)
    metrics = _maps(batch, "reward_metrics") if "reward_metrics" in names else None
    timings = _maps(batch, "timings") if "timings" in names else None
    reward_errors = reward_error_column(batch)
    episodes = episode_column(batch)
    return [
        Trajectory(
            uid=cols["uid"][i],
            group_id=cols["group_id"][i],
            group_size=cols["group_size"][i],
            prompt_ids=prompt_ids[i],
            response_ids=response_ids[i],
            behavior_logprobs=logprobs[i],
            token_versions=versions[i],
            score=cols["score"][i],
            finish_reason=cols["finish_reason"][i],
            data_source=cols["data_source"][i],
            engine_id=cols["engine_id"][i],
            prompt_index=cols["prompt_index"][i],
            reward_metrics=metrics[i] if metrics else {},
            timings=timings[i] if timings else {},
            temperature=cols["temperature"][i],
            loss_mask=masks[i],
            reward_error=reward_errors[i],
            episode=episodes[i],
        )
        for i in range(batch.num_rows)
    ]


def _row_masks(flat: np.ndarray, offsets: np.ndarray) -> list[Array | None]:
    """Per row: None when every token is trained (the wire's default), else the mask."""
    rows = (flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1))
    return [None if row.all() else Array.of(row, "uint8") for row in rows]


_SCALAR_COLUMNS = (
    "uid",
    "group_id",
    "group_size",
    "score",
    "finish_reason",
    "data_source",
    "engine_id",
    "prompt_index",
    "temperature",
)

METRIC_MAP = pa.map_(pa.string(), pa.float64())


def _maps(batch: pa.RecordBatch, name: str) -> list[dict[str, float]]:
    return [dict(row) if row is not None else {} for row in batch.column(name).to_pylist()]
