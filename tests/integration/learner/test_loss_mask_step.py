"""One learner step on a batch of multi-turn responses (tool tokens with loss mask 0).

The step must run and stay finite under every correction mode, and what a masked
token's behaviour logprob holds (0.0 as sent, or 50.0) must not change a single
weight: tool tokens are context for the tokens after them, never trained on.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from buffer.arrow_batch import arrow_to_trajectories, trajectories_to_arrow
from buffer.wire import Array
from learner.synthetic import synthetic_batch
from tests.integration.learner import procs


def tool_mask(index: int, length: int) -> list[int] | None:
    """Tool replies in the middle third of most responses; one sample tool-only, one
    ending on a tool reply, one untouched."""
    if index == 4:
        return [0] * length
    if index == 8:
        return [1] * 15 + [0] * (length - 15)
    if index == 1 or length < 3:
        return None
    return [0 if length // 3 <= t < 2 * length // 3 else 1 for t in range(length)]


MASKS = [tool_mask(i, n) for i, n in enumerate(procs.RESPONSE_LENS)]
TRAINED = sum(
    sum(m) if m is not None else n for m, n in zip(MASKS, procs.RESPONSE_LENS, strict=True)
)

SCENARIOS = {
    # GAE with the critic, decoupled PPO (π_prox recomputed), KL loss and entropy bonus
    "ppo_critic_decoupled": {},
    "grpo_tis_kl_in_reward": {
        "algorithm": {"adv_estimator": "grpo"},
        "correction": {"mode": "token_tis"},
        "kl": {"use_kl_in_reward": True, "kl_coef": 0.1, "use_kl_loss": False},
    },
    # bypass reads the behaviour logprobs as π_prox: the sharpest case for masked values
    "grpo_bypass": {
        "algorithm": {"adv_estimator": "grpo"},
        "correction": {"mode": "bypass"},
        "kl": {"use_kl_loss": False},
    },
    # sequence ratios: a tool token must stay out of every sequence mean
    "grpo_gspo_decoupled": {
        "algorithm": {"adv_estimator": "grpo"},
        "policy_loss": {"loss_mode": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        "kl": {"use_kl_loss": False},
    },
}


def batch(masks=MASKS, behavior_on_tools: float | None = None):
    arrow = synthetic_batch(
        vocab_size=60, groups=3, group_size=4, prompt_lens=[5, 7, 3],
        response_lens=procs.RESPONSE_LENS, seed=0, token_versions=procs.VERSIONS,
        loss_masks=masks,
    )  # fmt: skip
    if behavior_on_tools is None:
        return arrow
    changed = []
    for traj in arrow_to_trajectories(arrow):
        behavior = traj.behavior_logprobs.numpy()
        if traj.loss_mask is not None:
            tools = traj.loss_mask.numpy() == 0
            behavior = np.where(tools, behavior_on_tools, behavior)
        changed.append(
            msgspec.structs.replace(traj, behavior_logprobs=Array.of(behavior, "float32"))
        )
    return trajectories_to_arrow(changed)


def one_step(model_dir, arrow, overrides):
    torch.set_num_threads(1)
    worker = procs.make_worker(str(model_dir), 0, 1, procs.free_port(), overrides)
    try:
        metrics = worker.step(arrow, policy_version=1)
        weights = procs.full_weights(worker)
    finally:
        worker.close()
    return metrics, weights


def comparable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/peak"))}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_step_with_tool_tokens_is_finite_and_ignores_their_behavior_logprobs(
    tiny_model_dir, scenario
):
    overrides = SCENARIOS[scenario]
    sent = batch()
    metrics, weights = one_step(tiny_model_dir, sent, overrides)
    assert metrics["actor/skipped_nonfinite"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["response/trained_token_fraction"] == pytest.approx(
        TRAINED / sum(procs.RESPONSE_LENS)
    )
    assert metrics["response_length/mean"] == pytest.approx(np.mean(procs.RESPONSE_LENS))

    hostile_metrics, hostile_weights = one_step(
        tiny_model_dir, batch(behavior_on_tools=50.0), overrides
    )
    assert comparable(hostile_metrics) == comparable(metrics)
    assert hostile_weights.keys() == weights.keys()
    for name in weights:
        assert torch.equal(hostile_weights[name], weights[name]), name


def test_the_mask_changes_what_is_trained(tiny_model_dir):
    """Not vacuous: the same tokens without a mask train to other weights."""
    overrides = SCENARIOS["grpo_bypass"]
    _, masked = one_step(tiny_model_dir, batch(), overrides)
    _, unmasked = one_step(tiny_model_dir, batch(masks=None), overrides)
    moved = max((masked[n] - unmasked[n]).abs().max().item() for n in masked)
    assert moved > 1e-5
