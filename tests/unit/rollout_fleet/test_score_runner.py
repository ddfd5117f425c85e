"""How the reward engine cuts a batch into forwards: sorted by length, at most ``max_rows``
rows and ``max_batch_tokens`` padded tokens each, every input exactly once (a longer input
than the budget runs alone); scores come back in the inputs' order."""

from __future__ import annotations

import pytest

from rollout_fleet.engine.score_runner import ScoreRunner


@pytest.fixture(scope="module")
def runner(tiny_reward_dir):
    return ScoreRunner(tiny_reward_dir, max_rows=3, max_batch_tokens=40)


def test_forwards_respect_rows_and_padded_token_budget(runner):
    lengths = [5, 30, 2, 9, 9, 50, 1, 12]
    chunks = runner.forwards(lengths)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for chunk in chunks:
        assert len(chunk) <= runner.max_rows
        padded = len(chunk) * max(lengths[i] for i in chunk)
        assert padded <= runner.max_batch_tokens or len(chunk) == 1
    flat = [lengths[i] for c in chunks for i in c]
    assert flat == sorted(lengths)  # sorted: neighbours of similar length share a forward
    assert [50] in [[lengths[i] for i in c] for c in chunks]  # over budget: alone


def test_scores_keep_the_inputs_order_across_forwards(runner):
    prompts = [[3] * n for n in (7, 1, 20, 4)] + [[9, 8, 7]]
    together = runner.score(prompts)
    alone = [runner.score([p])[0] for p in prompts]
    assert len(together) == len(prompts)
    for a, b in zip(together, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_rm_eval_and_the_reward_engine_read_the_same_last_token(runner, tiny_reward_dir):
    """One read-out for every scorer: ``rm eval`` (transformers' folder) and the embedded
    reward engine agree, a sequence ending in the pad token included (transformers' own
    pooling would read the token before it)."""
    import torch

    from launcher.rm_eval import load_reward_model, score_sequences

    model, tokenizer = load_reward_model(tiny_reward_dir)
    pad = tokenizer.pad_token_id
    prompts = [[3, 4, 5, pad], [7] * 12, [9, 8]]
    engine = [row[0] for row in runner.score(prompts)]
    assert score_sequences(model, prompts).tolist() == pytest.approx(engine, abs=1e-5)
    pooled = model(input_ids=torch.tensor([prompts[0]])).logits[0, 0].item()
    assert engine[0] != pytest.approx(pooled, abs=1e-4)  # transformers reads one token early
