"""The learner's batch plan: token-balanced ranks, budgeted micro-batches, whole groups."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from learner.batching import (
    BatchError,
    GlobalBatch,
    balance_across_ranks,
    global_counts,
    micro_batches,
    mini_batches,
    padded,
    plan_ranks,
)
from learner.synthetic import lognormal_lengths, synthetic_batch


def test_from_arrow_reads_flat_columns_and_numbers_groups_in_order():
    arrow = synthetic_batch(
        vocab_size=50, groups=2, group_size=2, prompt_lens=[3, 4], response_lens=[2, 0, 5, 1]
    )
    gb = GlobalBatch.from_arrow(arrow)
    assert gb.group_index.tolist() == [0, 0, 1, 1]
    assert gb.response_lens.tolist() == [2, 0, 5, 1]
    assert gb.seq_lens.tolist() == [5, 3, 9, 5]
    assert gb.truncated.tolist() == [True, False, True, False]
    np.testing.assert_array_equal(gb.response(2), arrow.column("response_ids")[2].values)


def test_from_arrow_rejects_missing_columns_and_bad_temperature():
    arrow = synthetic_batch(
        vocab_size=50, groups=1, group_size=2, prompt_lens=3, response_lens=[2, 2]
    )
    with pytest.raises(BatchError, match="lacks columns"):
        GlobalBatch.from_arrow(arrow.drop_columns(["score"]))
    cold = arrow.set_column(
        arrow.schema.get_field_index("temperature"),
        "temperature",
        pa.array([1.0, 0.0], pa.float32()),
    )
    with pytest.raises(BatchError, match="row 1: temperature"):
        GlobalBatch.from_arrow(cold)


def test_balance_across_ranks_is_deterministic_covers_all_and_is_near_equal():
    costs = lognormal_lengths(64, median=50, sigma=1.0, low=1, high=2000, seed=0)
    shares = balance_across_ranks(np.arange(64), costs, 4)
    assert sorted(np.concatenate(shares).tolist()) == list(range(64))
    loads = [int(costs[s].sum()) for s in shares]
    assert max(loads) - min(loads) <= costs.max()  # LPT bound
    again = balance_across_ranks(np.arange(64), costs, 4)
    assert all(np.array_equal(a, b) for a, b in zip(shares, again, strict=True))


@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_respect_the_token_budget(packing):
    lens = np.array([30, 5, 7, 12, 3, 3, 25, 1])
    mbs = micro_batches(
        np.arange(8), lens, use_dynamic_bsz=True, max_tokens=32, micro_batch_size=0,
        packing=packing,
    )  # fmt: skip
    assert sorted(np.concatenate(mbs).tolist()) == list(range(8))
    for mb in mbs:
        cost = lens[mb].sum() if packing else lens[mb].max() * len(mb)
        assert cost <= 32 or len(mb) == 1


def test_oversized_sequence_gets_its_own_micro_batch_and_fixed_size_mode_counts():
    lens = np.array([100, 2, 2])
    mbs = micro_batches(
        np.arange(3), lens, use_dynamic_bsz=True, max_tokens=10, micro_batch_size=0, packing=True
    )
    assert [m.tolist() for m in mbs] == [[0], [1, 2]]
    fixed = micro_batches(
        np.arange(5), np.ones(5, int), use_dynamic_bsz=False, max_tokens=1, micro_batch_size=2,
        packing=True,
    )  # fmt: skip
    assert [m.tolist() for m in fixed] == [[0, 1], [2, 3], [4]]


def test_plan_ranks_pads_every_rank_to_the_same_micro_batch_count():
    lens = np.array([40, 1, 1, 1, 1, 1])
    plans = plan_ranks(
        np.arange(6), lens, 2, use_dynamic_bsz=True, max_tokens=2, micro_batch_size=0,
        packing=True,
    )  # fmt: skip
    assert len(plans[0]) == len(plans[1]) == 3
    assert [len(m) for m in plans[0]] == [1, 0, 0]  # rank 0 holds the long one, then padding
    one_rank = plan_ranks(
        np.arange(2), lens, 3, use_dynamic_bsz=True, max_tokens=100, micro_batch_size=0,
        packing=True,
    )  # fmt: skip
    assert [len(p) for p in one_rank] == [1, 1, 1] and len(one_rank[2][0]) == 0


def test_mini_batches_keep_groups_whole_and_counts_are_global():
    group_index = np.array([0, 0, 1, 1, 2, 2])
    minis = mini_batches(group_index, 2)
    assert [m.tolist() for m in minis] == [[0, 1, 2, 3], [4, 5]]
    assert [m.tolist() for m in mini_batches(group_index, 0)] == [list(range(6))]
    gb = GlobalBatch.from_arrow(
        synthetic_batch(
            vocab_size=50, groups=3, group_size=2, prompt_lens=3, response_lens=[2, 0, 5, 1, 4, 4]
        )
    )
    assert global_counts(gb, minis[0]) == (8, 3)


def test_padded_places_ragged_rows():
    out = padded(np.array([1, 2, 3, 4]), np.array([0, 1, 1, 4]))
    assert out.tolist() == [[1, 0, 0], [0, 0, 0], [2, 3, 4]]
