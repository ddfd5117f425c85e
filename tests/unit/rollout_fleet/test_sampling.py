"""Batched sampler: greedy rows, the reported logprob, top logprobs, top-k/top-p support, seeds."""

from __future__ import annotations

import torch

from rollout_fleet.engine.sampling import (
    BatchSampling,
    RowSampling,
    sample_next_tokens,
    sample_tokens,
)


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_rows_take_argmax_and_report_unit_temperature_logprob():
    logits = _logits()
    tokens, logprobs = sample_next_tokens(logits, BatchSampling([RowSampling(temperature=0.0)] * 4))
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected)


def test_reported_logprob_is_full_vocab_log_softmax_at_row_temperature():
    logits = _logits()
    rows = [
        RowSampling(temperature=1.0),
        RowSampling(temperature=0.7, top_p=0.9),
        RowSampling(temperature=0.5, top_k=3),
        RowSampling(temperature=0.0),
    ]
    tokens, logprobs = sample_next_tokens(logits, BatchSampling(rows))
    temps = torch.tensor([1.0, 0.7, 0.5, 1.0])[:, None]
    expected = torch.log_softmax(logits / temps, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)
    assert int(tokens[3]) == int(logits[3].argmax())


def test_top_k_and_top_p_restrict_the_support():
    logits = _logits(rows=1, vocab=30, seed=3).repeat(400, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    tokens, _ = sample_next_tokens(logits, BatchSampling([RowSampling(top_k=3)] * 400))
    assert set(tokens.tolist()) <= top3
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    keep = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    nucleus = set(order[:keep].tolist())
    tokens, _ = sample_next_tokens(logits, BatchSampling([RowSampling(top_p=0.5)] * 400))
    assert set(tokens.tolist()) <= nucleus


def test_sampling_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens, _ = sample_next_tokens(logits, BatchSampling([RowSampling(temperature=0.7)] * 20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015)


def test_seeded_rows_are_reproducible_and_independent_of_batch_mates():
    logits = _logits(rows=2, vocab=40, seed=5)

    def draw(seed: int) -> list[int]:
        out = []
        gen = torch.Generator().manual_seed(seed)
        for _ in range(20):
            rows = [RowSampling(generator=gen), RowSampling()]
            out.append(int(sample_next_tokens(logits, BatchSampling(rows))[0][0]))
        return out

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_logprobs_are_the_largest_of_the_distribution_the_logprob_comes_from():
    logits = _logits()
    rows = [RowSampling(temperature=0.7, top_p=0.9, top_logprobs=5), RowSampling(temperature=0.0,
            top_logprobs=2), RowSampling(temperature=1.0), RowSampling(top_logprobs=50)]  # fmt: skip
    out = sample_tokens(logits, BatchSampling(rows))
    temps = torch.tensor([0.7, 1.0, 1.0, 1.0])[:, None]
    full = torch.log_softmax(logits / temps, -1)
    assert out.top_values.shape == out.top_ids.shape == (4, 50)  # the batch's largest k
    assert torch.allclose(out.top_values, full.sort(-1, descending=True).values, atol=1e-6)
    assert torch.equal(full.gather(-1, out.top_ids), out.top_values)
    # a greedy row's first entry is its sampled token, with the logprob it reports
    assert int(out.top_ids[1, 0]) == int(out.tokens[1])
    assert float(out.top_values[1, 0]) == float(out.logprobs[1])
    assert sample_tokens(logits, BatchSampling([RowSampling()] * 4)).top_values is None
