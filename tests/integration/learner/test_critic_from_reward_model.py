"""learner.critic.init_from: the PPO critic starts as the reward model (OpenRLHF's default).

Before any update the critic's value at each sequence's last token must equal the score
the reward model gives that sequence (transformers' own sequence classifier over the
folder), its backbone must be the reward model's, not the policy's, and a folder that is
no reward model of the policy's tokens is refused naming the key.
"""

from __future__ import annotations

import pytest
import torch

from fleetrl.config import ConfigError
from fleetrl.models.tiny import make_tiny_model
from tests.integration.learner import procs

SEQUENCES = [[4, 10, 11, 12, 5], [4, 20, 21, 22, 23, 24, 25, 5], [4, 30, 5]]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A reward model of another shape than the policy (1 layer, hidden 32), same tokenizer."""
    return make_tiny_model(
        tmp_path_factory.mktemp("rm") / "rm", layers=1, hidden=32, heads=2, seed=5, reward_model=True
    )  # fmt: skip


def test_critic_values_at_the_last_token_equal_the_reward_model_scores_before_training(
    tiny_model_dir, reward_model_dir
):
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(1)
    overrides = {"critic": {"init_from": str(reward_model_dir), "optim": {"lr": 1e-3}}}
    worker = procs.make_worker(str(tiny_model_dir), 0, 1, procs.free_port(), overrides)
    try:
        assert worker.critic is not None
        assert worker.critic.config.hidden_size == 32  # the reward model's backbone
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
        worker.critic.eval()
        with torch.no_grad():
            for seq in SEQUENCES:
                ids = torch.tensor([seq])
                value = worker.critic(input_ids=ids).logits[0, -1, 0]
                score = reward_model(input_ids=ids).logits[0, 0]
                torch.testing.assert_close(value, score, atol=1e-5, rtol=0)
        bias = worker.critic.score.bias.detach()  # a DTensor under FSDP2, plain on one rank
        bias = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
        assert float(bias.abs().max()) == 0.0
    finally:
        worker.close()


def test_a_folder_that_is_not_a_reward_model_of_the_policy_s_tokens_is_refused(
    tiny_model_dir, tmp_path
):
    from launcher.config import load_run_config

    keys = ["learner.algorithm.adv_estimator=gae", f"model.path={tiny_model_dir}"]
    with pytest.raises(ConfigError, match=r"learner.critic.init_from: reward model .* hold no \*ForSequenceClassification"):  # fmt: skip
        load_run_config(None, [*keys, f"learner.critic.init_from={tiny_model_dir}"], training=True)  # fmt: skip
    with pytest.raises(ConfigError, match="no critic is built"):
        load_run_config(None, [f"learner.critic.init_from={tiny_model_dir}"])
    other_vocab = make_tiny_model(tmp_path / "rm", alphabet="0123456789", reward_model=True)
    torch.set_num_threads(1)
    overrides = {"critic": {"init_from": str(other_vocab)}}
    with pytest.raises(ValueError, match="vocab_size 16 is not the policy's"):
        procs.make_worker(str(tiny_model_dir), 0, 1, procs.free_port(), overrides)
