"""The reward-model folder contract: a one-label classifier, its score statistics kept in
config.json (ours, or OpenRLHF's bare mean/std), bad folders refused naming the folder."""

from __future__ import annotations

import json

import pytest

from fleetrl.models.reward_folder import (
    STATS_KEY,
    RewardFolderError,
    RewardStats,
    check_reward_folder,
    read_reward_stats,
    write_reward_stats,
)
from fleetrl.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("rm"), layers=1, hidden=16, heads=2, reward_model=True
    )


def test_tiny_reward_model_is_a_one_label_sequence_classifier(rm_dir):
    from transformers import AutoModelForSequenceClassification

    config = check_reward_folder(rm_dir)
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    assert model.config.num_labels == 1


def test_stats_round_trip_and_keep_the_rest_of_the_config(rm_dir, tmp_path):
    before = json.loads((rm_dir / "config.json").read_text())
    assert read_reward_stats(rm_dir) is None
    write_reward_stats(rm_dir, RewardStats(mean=0.25, std=1.5, pairs=40, accuracy=0.9))
    after = json.loads((rm_dir / "config.json").read_text())
    assert {k: v for k, v in after.items() if k != STATS_KEY} == before
    assert read_reward_stats(rm_dir) == RewardStats(mean=0.25, std=1.5, pairs=40, accuracy=0.9)


def test_openrlhf_mean_and_std_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"mean": -0.5, "std": 2.0}))
    assert read_reward_stats(tmp_path) == RewardStats(mean=-0.5, std=2.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"architectures": ["Qwen2ForCausalLM"]}, "hold no"),
        ({"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 3}, "3 labels"),
    ],
)
def test_a_folder_that_is_not_a_reward_model_is_refused_naming_it(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardFolderError, match=message) as err:
        check_reward_folder(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_unusable_stats_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({STATS_KEY: {"mean": 0.0, "std": 0.0}}))
    with pytest.raises(RewardFolderError, match="unusable"):
        read_reward_stats(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RewardFolderError, match="not JSON"):
        read_reward_stats(tmp_path)
