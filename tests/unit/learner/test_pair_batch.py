"""Pair batches: both responses of a pair in one forward, the last tokens read, plans by pair."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from fleetrl.data.pairs import PAIR_SCHEMA
from learner.batching import BatchError
from learner.packing import value_forward
from learner.pair_batch import PairBatch, build_pair_inputs, plan_pairs, split_scores

EOS = 5
# (chosen, rejected) token ids, each ending with EOS; lengths differ inside and across pairs
PAIRS = [
    ([7, 8, 9, EOS], [7, 8, 10, 11, 12, EOS]),
    ([20, 21, EOS], [20, 22, EOS]),
    ([30, 31, 32, 33, 34, 35, 36, EOS], [30, EOS]),
]


def pair_arrow(pairs, margins=None) -> pa.RecordBatch:
    margins = margins or [0.0] * len(pairs)
    return pa.RecordBatch.from_pydict(
        {
            "chosen_ids": [c for c, _ in pairs],
            "rejected_ids": [r for _, r in pairs],
            "margin": margins,
            "pair_index": list(range(len(pairs))),
        },
        schema=PAIR_SCHEMA,
    )


@pytest.fixture(scope="module")
def scorer(tiny_model_dir):
    """The tiny model as the learner trains a reward model: one-label head, no bias."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.update({"num_labels": 1, "token_classification_bias": False, "classifier_dropout": 0.0})
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, config=config)
    assert model.score.bias is None
    torch.nn.init.normal_(model.score.weight, std=0.5)
    return model.eval()


def test_one_micro_batch_holds_chosen_then_rejected_and_reads_each_last_token():
    batch = PairBatch.from_arrow(pair_arrow(PAIRS))
    for packing in (True, False):
        mb = build_pair_inputs(batch, np.array([2, 0]), packing=packing, device=torch.device("cpu"))
        ids = mb.input_ids.numpy()
        read = ids[mb.rows.numpy(), mb.cols.numpy()]
        assert read.tolist() == [EOS] * 4  # every read-out position is a sequence's EOS
        # in order: chosen of pair 2, chosen of pair 0, rejected of pair 2, rejected of pair 0
        seqs = [PAIRS[2][0], PAIRS[0][0], PAIRS[2][1], PAIRS[0][1]]
        for (row, col), seq in zip(zip(mb.rows.tolist(), mb.cols.tolist(), strict=True), seqs, strict=True):  # fmt: skip
            assert ids[row, col - len(seq) + 1 : col + 1].tolist() == seq
        if packing:  # every position restarts at 0 where its sequence starts
            assert mb.attention_mask is None
            for row, col, seq in zip(mb.rows.tolist(), mb.cols.tolist(), seqs, strict=True):
                assert mb.position_ids[row, col].item() == len(seq) - 1
        else:
            assert mb.attention_mask.sum().item() == sum(len(s) for s in seqs)


def test_packed_and_padded_scores_equal_each_sequence_scored_alone(scorer):
    batch = PairBatch.from_arrow(pair_arrow(PAIRS))
    indices = np.arange(3)
    alone = []
    with torch.no_grad():
        for seq in [c for c, _ in PAIRS] + [r for _, r in PAIRS]:
            alone.append(scorer(input_ids=torch.tensor([seq])).logits[0, -1, 0])
        alone = torch.stack(alone)
        for packing, row_tokens in ((True, None), (True, 10), (False, None)):
            mb = build_pair_inputs(batch, indices, packing=packing, device=torch.device("cpu"), row_tokens=row_tokens)  # fmt: skip
            scores, _ = value_forward(scorer, mb)
            torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)
            chosen, rejected = split_scores(scores, mb)
            torch.testing.assert_close(chosen, alone[:3], atol=1e-5, rtol=0)
            torch.testing.assert_close(rejected, alone[3:], atol=1e-5, rtol=0)


def test_an_empty_share_still_runs_a_forward_that_reads_nothing(scorer):
    batch = PairBatch.from_arrow(pair_arrow(PAIRS))
    mb = build_pair_inputs(batch, np.zeros(0, np.int64), packing=True, device=torch.device("cpu"))
    scores, anchor = value_forward(scorer, mb)
    assert scores.numel() == 0 and float(anchor.detach()) == 0.0


def test_plans_split_pairs_never_sequences_within_the_token_budget():
    many = PAIRS * 4
    batch = PairBatch.from_arrow(pair_arrow(many))
    assert batch.pair_costs(True).tolist()[:3] == [10, 6, 10]
    assert batch.pair_costs(False).tolist()[:3] == [12, 6, 16]
    seen = []
    for rank in range(2):
        plan = plan_pairs(
            batch, np.arange(len(many)), 2, rank,
            use_dynamic_bsz=True, max_tokens=20, micro_batch_size=1, packing=True,
        )  # fmt: skip
        for mb in plan:
            assert batch.pair_costs(True)[mb].sum() <= 20
            seen.extend(mb.tolist())
    assert sorted(seen) == list(range(len(many)))  # each pair once, on one rank
    fixed = plan_pairs(
        batch, np.arange(len(many)), 1, 0,
        use_dynamic_bsz=False, max_tokens=1, micro_batch_size=5, packing=False,
    )  # fmt: skip
    assert [len(mb) for mb in fixed] == [5, 5, 2]


def test_bad_pair_batches_are_refused():
    with pytest.raises(BatchError, match="row 1: empty rejected_ids"):
        PairBatch.from_arrow(pair_arrow([([1, EOS], [2, EOS]), ([1, EOS], [])]))
    with pytest.raises(BatchError, match="lacks columns"):
        PairBatch.from_arrow(pa.RecordBatch.from_pydict({"chosen_ids": [[1]]}))
