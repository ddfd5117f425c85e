"""Packed micro-batches give the same per-token logprobs as padded ones (and as one
sequence at a time), for the Qwen2 and Llama tiny models, in one row or bin-packed
into several; the row budget follows the attention implementation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fleetrl.models.loading import load_causal_lm
from learner.batching import GlobalBatch
from learner.packing import (
    MIN_ROW_TOKENS,
    build_inputs,
    pack_rows,
    packed_row_budget,
    padding_is_cheaper,
    policy_forward,
    split_by_sequence,
)
from learner.synthetic import synthetic_batch

LENS = [3, 0, 7, 1, 5, 9]


@pytest.fixture(scope="module")
def batch() -> GlobalBatch:
    arrow = synthetic_batch(
        vocab_size=60, groups=2, group_size=3, prompt_lens=[4, 6], response_lens=LENS,
        seed=3, temperature=0.8,
    )  # fmt: skip
    return GlobalBatch.from_arrow(arrow)


def logprobs(model, batch: GlobalBatch, indices, packing: bool, row_tokens=None) -> torch.Tensor:
    mb = build_inputs(
        batch, np.asarray(indices), packing=packing, device=torch.device("cpu"),
        row_tokens=row_tokens,
    )  # fmt: skip
    with torch.no_grad():
        return policy_forward(model, mb).logprobs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_logprobs_equal_padded_and_one_at_a_time(
    arch, batch, tiny_model_dir, tiny_llama_dir
):
    torch.set_num_threads(1)
    model = load_causal_lm(tiny_model_dir if arch == "qwen2" else tiny_llama_dir).eval()
    everything = list(range(batch.size))
    packed = logprobs(model, batch, everything, packing=True)
    padded = logprobs(model, batch, everything, packing=False)
    alone = torch.cat([logprobs(model, batch, [i], packing=True) for i in everything])
    assert packed.shape == (sum(LENS),)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_packing_without_restarting_positions_would_leak_across_sequences(batch, tiny_model_dir):
    """Guards the test above: continuous position ids (no boundaries) change the result."""
    model = load_causal_lm(tiny_model_dir).eval()
    mb = build_inputs(batch, np.arange(batch.size), packing=True, device=torch.device("cpu"))
    mb.position_ids = torch.arange(mb.input_ids.shape[1])[None, :]
    with torch.no_grad():
        leaked = policy_forward(model, mb).logprobs
    assert not torch.allclose(leaked, logprobs(model, batch, range(batch.size), True), atol=1e-3)


def test_logprobs_use_the_rollout_temperature(batch, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).eval()
    mb = build_inputs(batch, np.array([2]), packing=True, device=torch.device("cpu"))
    with torch.no_grad():
        got = policy_forward(model, mb).logprobs
        logits = model(input_ids=mb.input_ids).logits[0]
    prompt_len = int(batch.prompt_lens[2])
    rows = logits[prompt_len - 1 : prompt_len - 1 + LENS[2]] / 0.8
    expected = torch.log_softmax(rows, -1).gather(-1, mb.labels[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_split_by_sequence_right_pads_each_sequence(batch):
    mb = build_inputs(batch, np.array([0, 1, 2]), packing=True, device=torch.device("cpu"))
    flat = torch.arange(mb.num_tokens, dtype=torch.float32) + 1
    out = split_by_sequence(flat, mb)
    assert out.shape == (3, 7)
    assert out[0, :3].tolist() == [1, 2, 3] and out[0, 3:].abs().sum() == 0
    assert out[1].abs().sum() == 0
    assert out[2].tolist() == [4, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("row_tokens", [9, 13, 20])
def test_packed_rows_under_a_budget_equal_padded(
    arch, row_tokens, batch, tiny_model_dir, tiny_llama_dir
):
    """Several rows (tails padded with blocks of their own) give the padded logprobs."""
    torch.set_num_threads(1)
    model = load_causal_lm(tiny_model_dir if arch == "qwen2" else tiny_llama_dir).eval()
    everything = list(range(batch.size))
    mb = build_inputs(
        batch, np.arange(batch.size), packing=True, device=torch.device("cpu"),
        row_tokens=row_tokens,
    )  # fmt: skip
    assert mb.input_ids.shape[0] > 1  # the budget really split the micro-batch
    assert mb.input_ids.shape[1] <= max(row_tokens, int(batch.seq_lens.max()))
    # no position beyond the longest sequence, tails included: GPT-2's wpe has no more
    assert int(mb.position_ids.max()) < int(batch.seq_lens.max())
    got = logprobs(model, batch, everything, packing=True, row_tokens=row_tokens)
    torch.testing.assert_close(
        got, logprobs(model, batch, everything, packing=False), atol=1e-5, rtol=0
    )


def test_pack_rows_first_fit_longest_first():
    lens = np.array([5, 9, 3, 7, 2, 12])
    row_of, start_of, rows, width = pack_rows(lens, 12)
    # longest first: 12 | 9, then 7 in a new row, 5 beside 7, 3 beside 9, 2 in a fourth row
    fills = np.bincount(row_of, weights=lens, minlength=rows)
    assert fills.max() <= 12 and width == 12 and rows == 4
    for r in range(rows):  # sequences of a row are contiguous from column 0
        mine = np.flatnonzero(row_of == r)
        spans = sorted((start_of[j], start_of[j] + lens[j]) for j in mine)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    one = pack_rows(lens, None)
    assert one[2] == 1 and one[3] == lens.sum() and one[1].tolist() == [0, 5, 14, 17, 24, 26]


def test_pack_rows_gives_a_longer_sequence_its_own_row():
    row_of, _, rows, width = pack_rows(np.array([4, 30, 4]), 10)
    assert width == 30 and row_of[1] != row_of[0] and row_of[0] == row_of[2] and rows == 2


def test_row_budget_follows_the_attention():
    lens = np.array([40, 300, 12])
    assert packed_row_budget("flash_attention_2", 0, lens) is None  # varlen: one row is linear
    assert packed_row_budget("sdpa", 0, lens, sp_size=2) is None  # Ulysses splits one row
    assert packed_row_budget("sdpa", 0, lens) == 300  # the longest sequence
    assert packed_row_budget("eager", 0, np.array([10, 20])) == MIN_ROW_TOKENS
    assert packed_row_budget("sdpa", 64, lens) == 64  # configured


def test_short_similar_sequences_are_padded_and_long_tails_packed():
    demo = np.random.default_rng(0).integers(24, 28, size=128)  # the CPU demo's batch
    assert padding_is_cheaper(demo, MIN_ROW_TOKENS, hidden=64)
    tail = np.minimum(np.random.default_rng(1).lognormal(np.log(40), 1.2, 64), 400).astype(int)
    tail[0] = 400  # one straggler: padding every row to it costs more than packing
    assert not padding_is_cheaper(tail + 20, int(tail.max()) + 20, hidden=64)
    assert not padding_is_cheaper(np.array([30]), MIN_ROW_TOKENS, hidden=64)  # nothing to pack


def test_a_short_rows_padding_never_takes_a_position_beyond_the_longest_sequence():
    """Learned position tables (GPT-2's wpe: n_positions rows) hold no position past the
    longest sequence a run allows: a row's padding restarts within it."""
    from learner.packing import layout_sequences

    seqs = [np.arange(5) + 6] * 4 + [np.array([7, 8])]
    layout = layout_sequences(seqs, packing=True, row_tokens=20)
    assert layout.ids.shape == (2, 20)  # four sequences fill row 0; row 1 holds 2 real tokens
    assert layout.positions.max() == 4
    assert layout.positions[1].tolist() == [0, 1, *([0, 1, 2, 3, 4] * 3), 0, 1, 2]
