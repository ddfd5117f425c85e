"""Samples whose reward failed travel with their group but train nothing.

The reference for every check is the same batch with the failed rows taken out:
loss, gradients, advantages and group statistics of the valid rows must be what
they are without them, even when the failed rows carry hostile values (a NaN or
huge score, behaviour logprob 50, policy logprob −80 or NaN), and every failed
row's gradient is exactly 0. A group left with one valid sample of several has
no baseline: its advantage is 0 under GRPO, Dr. GRPO and RLOO.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import torch

from buffer.arrow_batch import arrow_to_trajectories, trajectories_to_arrow
from learner import algorithms as alg
from learner.batching import GlobalBatch, global_counts, response_mask
from learner.config import LearnerConfig
from learner.prepare import batch_metrics, make_kl_controller, prepare_targets
from learner.synthetic import synthetic_batch
from tests.unit.learner.test_loss_mask_losses import learner_grpo, learner_ppo, random_logprobs

# two groups of four; the longest response (row 2, 9 tokens) is valid, so the padded
# width is the same with and without the failed rows
LENS = [5, 7, 9, 4, 6, 3, 8, 5]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75]
FAILED = {1: "reward function raised ValueError('x')", 6: "reward model: server down"}
HOSTILE_SCORES = {1: math.nan, 6: 1e30}


def _trajectories(failed: dict[int, str], hostile: bool):
    arrow = synthetic_batch(
        vocab_size=50, groups=2, group_size=4, prompt_lens=[3, 4], response_lens=LENS, seed=7
    )
    out = []
    for i, traj in enumerate(arrow_to_trajectories(arrow)):
        changes: dict = {"score": SCORES[i]}
        if i in failed:
            changes["reward_error"] = failed[i]
            if hostile:
                changes["score"] = HOSTILE_SCORES.get(i, -1e30)
                behavior = np.full(LENS[i], 50.0, dtype=np.float32)
                changes["behavior_logprobs"] = type(traj.behavior_logprobs).of(behavior, "float32")
        out.append(msgspec.structs.replace(traj, **changes))
    return out


def failed_batch(hostile: bool = True) -> GlobalBatch:
    return GlobalBatch.from_arrow(trajectories_to_arrow(_trajectories(FAILED, hostile)))


def valid_only_batch() -> GlobalBatch:
    """The reference: the failed rows are not in the batch at all."""
    kept = [t for i, t in enumerate(_trajectories({}, False)) if i not in FAILED]
    return GlobalBatch.from_arrow(trajectories_to_arrow(kept))


KEPT = [i for i in range(len(LENS)) if i not in FAILED]


def with_hostile_rows(lp: dict[str, torch.Tensor], fills: dict[str, float]):
    rows = torch.zeros(len(LENS), 1, dtype=torch.bool)
    rows[list(FAILED)] = True
    return {k: torch.where(rows, torch.full_like(t, fills[k]), t) if k in fills else t for k, t in lp.items()}  # fmt: skip


def test_a_failed_reward_reads_as_invalid_with_no_trained_token_and_no_score():
    gb = failed_batch()
    assert gb.reward_valid.tolist() == [i not in FAILED for i in range(len(LENS))]
    assert gb.trained_lens.tolist() == [0 if i in FAILED else n for i, n in enumerate(LENS)]
    assert gb.scores[list(FAILED)].tolist() == [0.0, 0.0]  # NaN and 1e30 never get through
    mask = response_mask(gb)
    assert mask[list(FAILED)].sum() == 0
    tokens, seqs = global_counts(gb, np.arange(gb.size))
    assert (tokens, seqs) == (sum(LENS[i] for i in KEPT), len(KEPT))


def test_a_non_finite_score_without_an_error_is_treated_as_failed_too():
    trajs = _trajectories({}, False)
    trajs[3] = msgspec.structs.replace(trajs[3], score=math.inf)
    gb = GlobalBatch.from_arrow(trajectories_to_arrow(trajs))
    assert not gb.reward_valid[3] and gb.reward_valid.sum() == 7
    assert gb.trained_lens[3] == 0


def test_a_batch_without_the_column_reads_every_reward_as_scored():
    arrow = trajectories_to_arrow(_trajectories(FAILED, False)).drop_columns(["reward_error"])
    gb = GlobalBatch.from_arrow(arrow)
    assert gb.reward_valid.all()
    assert gb.trained_lens.tolist() == LENS


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grpo_loss_and_gradient_equal_the_batch_without_the_failed_samples(mode):
    gb, reference = failed_batch(), valid_only_batch()
    lp = with_hostile_rows(
        random_logprobs(gb, seed=3), {"logprob": -80.0, "prox": math.nan, "ref": 50.0}
    )
    logprob = lp["logprob"].clone().requires_grad_(True)
    loss, metrics = learner_grpo(gb, lp, logprob, mode)
    (grad,) = torch.autograd.grad(loss, logprob)

    ref_lp = {k: v[KEPT] for k, v in random_logprobs(gb, seed=3).items()}
    ref_logprob = ref_lp["logprob"].clone().requires_grad_(True)
    expected, expected_metrics = learner_grpo(reference, ref_lp, ref_logprob, mode)
    (expected_grad,) = torch.autograd.grad(expected, ref_logprob)

    assert math.isfinite(loss.item())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grad[KEPT], expected_grad, rtol=1e-6, atol=1e-8)
    assert torch.all(grad[list(FAILED)] == 0)
    assert grad.abs().sum() > 0
    for key in ("critic/advantages/mean", "critic/advantages/max", "actor/reward_kl_penalty"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-6, abs=1e-9), key


def test_ppo_with_a_critic_ignores_failed_samples_and_their_values():
    gb, reference = failed_batch(), valid_only_batch()
    fills = {"logprob": -80.0, "values": 1e3, "new_values": -1e3}
    lp = with_hostile_rows(random_logprobs(gb, seed=5), fills)
    logprob = lp["logprob"].clone().requires_grad_(True)
    new_values = lp["new_values"].clone().requires_grad_(True)
    pg, vf = learner_ppo(gb, lp, logprob, new_values)
    grads = torch.autograd.grad(pg + vf, (logprob, new_values))

    ref_lp = {k: v[KEPT] for k, v in random_logprobs(gb, seed=5).items()}
    ref_logprob = ref_lp["logprob"].clone().requires_grad_(True)
    ref_values = ref_lp["new_values"].clone().requires_grad_(True)
    ref_pg, ref_vf = learner_ppo(reference, ref_lp, ref_logprob, ref_values)
    ref_grads = torch.autograd.grad(ref_pg + ref_vf, (ref_logprob, ref_values))
    torch.testing.assert_close(pg, ref_pg, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(vf, ref_vf, rtol=1e-5, atol=1e-7)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine[KEPT], theirs, rtol=1e-5, atol=1e-7)
        assert torch.all(mine[list(FAILED)] == 0)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_pp"])
def test_advantages_of_the_valid_samples_are_those_of_the_batch_without_the_failed(estimator):
    gb, reference = failed_batch(), valid_only_batch()
    cfg = msgspec.convert(
        {"algorithm": {"adv_estimator": estimator}, "correction": {"mode": "bypass"}},
        LearnerConfig,
    )

    def advantages(batch: GlobalBatch) -> torch.Tensor:
        targets, _ = prepare_targets(
            batch, cfg, prox_logprob=None, ref_logprob=None, values=None,
            kl_ctrl=make_kl_controller(cfg), device=torch.device("cpu"),
        )  # fmt: skip
        return targets.advantages

    mine, theirs = advantages(gb), advantages(reference)
    assert torch.isfinite(mine).all()
    torch.testing.assert_close(mine[KEPT], theirs, rtol=1e-6, atol=1e-7)
    assert torch.all(mine[list(FAILED)] == 0)
    if estimator == "grpo":  # the statistics are over the valid samples of group 0: 1, 1, 0.5
        group = torch.tensor([1.0, 1.0, 0.5])
        expected = (group - group.mean()) / (group.std() + 1e-6)
        assert mine[3, 0].item() == pytest.approx(expected[2].item(), rel=1e-5)


def test_score_metrics_cover_the_scored_samples_and_count_the_failed():
    metrics = batch_metrics(failed_batch(), policy_version=0)
    scored = [SCORES[i] for i in KEPT]
    assert metrics["critic/score/mean"] == pytest.approx(np.mean(scored))
    assert metrics["critic/score/max"] == 1.0 and metrics["critic/score/min"] == 0.25
    assert metrics["reward/failed_in_batch"] == 2.0
    assert metrics["response/trained_token_fraction"] == pytest.approx(
        sum(LENS[i] for i in KEPT) / sum(LENS)
    )
    assert metrics["response_length/mean"] == pytest.approx(np.mean(LENS))  # all generated


def _one_group(scores: list[float], valid: list[bool]) -> dict[str, torch.Tensor]:
    values = torch.tensor(scores, dtype=torch.float64)
    mask = torch.ones(len(scores), 2)
    ids = [0] * len(scores)
    flags = torch.tensor(valid)
    return {
        "grpo": alg.compute_grpo_advantages(values, ids, mask, valid=flags)[:, 0],
        "drgrpo": alg.compute_grpo_advantages(values, ids, mask, norm_by_std=False, valid=flags)[
            :, 0
        ],  # fmt: skip
        "rloo": alg.compute_rloo_advantages(values, ids, mask, valid=flags)[:, 0],
    }


def test_a_group_left_with_one_valid_sample_has_no_baseline_and_gets_zero_advantage():
    for name, adv in _one_group([0.8, math.nan, -5.0], [True, False, False]).items():
        assert adv.tolist() == [0.0, 0.0, 0.0], name
    # a group of one sample (n = 1) keeps verl's behaviour: its raw score
    for name, adv in _one_group([0.8], [True]).items():
        assert adv.tolist() == [pytest.approx(0.8)], name


def test_rloo_leaves_each_valid_sample_out_against_the_other_valid_ones():
    adv = _one_group([1.0, 0.0, math.inf, 0.5], [True, True, False, True])["rloo"]
    assert adv.tolist() == pytest.approx([1.0 - 0.25, 0.0 - 0.75, 0.0, 0.5 - 0.5])


def test_valid_must_have_one_flag_per_sample():
    with pytest.raises(ValueError, match=r"valid shape \(2,\) must be \[3\]"):
        alg.compute_grpo_advantages(
            torch.zeros(3), [0, 0, 0], torch.ones(3, 1), valid=torch.ones(2, dtype=torch.bool)
        )


def test_the_arrow_column_round_trips_and_old_segments_read_as_scored():
    trajs = _trajectories(FAILED, False)
    back = arrow_to_trajectories(trajectories_to_arrow(trajs))
    assert [t.reward_error for t in back] == [FAILED.get(i, "") for i in range(len(LENS))]
    old = trajectories_to_arrow(trajs).drop_columns(["reward_error"])
    assert all(t.reward_error == "" for t in arrow_to_trajectories(old))
    assert trajectories_to_arrow(trajs).schema.field("reward_error").type == pa.string()
