"""Reward-model scores on the real stack: the worker on an embedded engine (tiny policy), a tiny
transformers reward model with ANOTHER tokenizer and chat template, built from its folder
by ``build_model_scorer`` (tokenizer, score statistics, context).

Proves: each trajectory's ``model_score_raw`` is what transformers'
``AutoModelForSequenceClassification`` gives the response re-rendered for the reward
model (its template, OpenRLHF's EOS rule, its tokens), in the right order within the
group; ``model_score`` is that, standardised with the folder's statistics and clipped;
each group is one client call. The client here runs the model in process (the real one,
rollout_fleet/rewards/model_client.py, is tested over HTTP in the reward fault tests).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from fleetrl.models.reward_folder import RewardStats, write_reward_stats
from fleetrl.models.tiny import make_tiny_model
from rollout_fleet.rewards.config import RewardModelConfig
from rollout_fleet.rewards.model_scorer import build_model_scorer
from rollout_fleet.rewards.pipeline import RewardPipeline
from rollout_fleet.rewards.runner import RewardRunner
from tests.integration.rollout_fleet.test_worker_embedded import (
    make_worker,
    parity_reward,
    prompts,
    run_then_close,
)

TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"  # not the policy's ChatML
STATS = RewardStats(mean=0.05, std=0.02, pairs=8)
CLIP = 3.0


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = make_tiny_model(
        tmp_path_factory.mktemp("rm") / "rm", layers=1, hidden=32, heads=2, seed=3,
        alphabet="0123456789+=:? abcdefghijklmnopqrstuvwxyz\n", reward_model=True,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    write_reward_stats(folder, STATS)
    return folder


class TransformersClient:
    """The client interface, scoring in process with the folder's model, one item at a time."""

    def __init__(self, folder):
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        self.calls: list[int] = []

    def set_servers(self, servers):
        pass

    async def score(self, input_ids):
        self.calls.append(len(input_ids))
        with torch.no_grad():
            return [float(self.model(torch.tensor([ids])).logits[0, 0]) for ids in input_ids]

    def stats(self):
        return {"reward_model/requests": float(len(self.calls))}

    async def aclose(self):
        pass


def reference_score(folder, messages, response: str) -> float:
    """The reward model's score of the response, computed here from scratch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    turn = [*messages, {"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(turn, tokenize=False).rstrip()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if ids[-1] != tokenizer.eos_token_id:  # the score is read at an EOS id, never its text
        ids.append(tokenizer.eos_token_id)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return float(model(torch.tensor([ids])).logits[0, 0])


def test_model_scores_are_the_reward_models_own_on_the_re_rendered_response(
    engine, tokenizer, reward_folder
):
    clients: list[TransformersClient] = []

    def factory(servers, **kwargs):
        clients.append(TransformersClient(reward_folder))
        return clients[-1]

    config = RewardModelConfig(
        path=str(reward_folder), urls=["http://unused"], clip=CLIP, max_length=0
    )
    model = build_model_scorer(config, {"reward-0": "http://unused"}, None, client_factory=factory)
    assert model.inputs.chat_template == "auto" and model.inputs.max_length == 512
    rewards = RewardPipeline(RewardRunner(5, 2, parity_reward), model, rule_weight=1.0)
    items = prompts(tokenizer, 2)
    for position, item in enumerate(items):  # messages for the reward model to re-render
        item.raw_prompt.append({"role": "user", "content": f"{position}+{position}="})
    worker, _, sink = make_worker([engine], tokenizer, n=3, items=items, rewards=rewards)
    run_then_close(worker, worker.run(num_groups=2))
    assert len(sink.trajectories) == 6 and clients[0].calls == [3, 3]  # one call per group
    by_prompt = {item.index: item for item in items}
    for traj in sink.trajectories:
        response = tokenizer.decode(traj.response_ids.numpy(), skip_special_tokens=True)
        messages = by_prompt[traj.prompt_index].raw_prompt
        raw = reference_score(reward_folder, messages, response)
        metrics = traj.reward_metrics
        assert metrics["model_score_raw"] == pytest.approx(raw, abs=1e-5)
        expected = max(-CLIP, min(CLIP, (raw - STATS.mean) / STATS.std))
        assert metrics["model_score"] == pytest.approx(expected, abs=1e-3)
        assert traj.score == pytest.approx(metrics["rule_score"] + metrics["model_score"])
    asyncio.run(rewards.aclose())
