"""Every shipped run config validates, and the configuration reference matches the code.

The reference test freezes the config surface: adding, renaming or re-documenting
a key fails until `make docs` regenerates docs/configuration.md, so the docs
cannot drift from the structs and the surface cannot grow by accident.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetrl.config import field_docs
from launcher.config import RunConfig, load_run_config
from launcher.config_cmd import render_docs

REPO = Path(__file__).resolve().parents[3]
# reward-model configs (`fleetrl rm train`) have an `rm` section; the others are RL runs
RM_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if "rm" in yaml.safe_load(p.read_text()))  # fmt: skip
RUN_CONFIGS = sorted(set((REPO / "configs").glob("*.yaml")) - set(RM_CONFIGS))


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_shipped_run_config_validates(path: Path):
    cfg = load_run_config(path)
    assert cfg.trainer.total_steps >= 1


@pytest.mark.parametrize("path", RM_CONFIGS, ids=lambda p: p.name)
def test_shipped_reward_model_config_validates(path: Path):
    from launcher.rm_config import load_rm_config

    cfg = load_rm_config(path)
    assert cfg.trainer.total_steps >= 1 and cfg.data.train_files


def test_gpu_configs_follow_the_documented_recipes():
    grpo = load_run_config(REPO / "configs/gsm8k_grpo_qwen2.5_7b.yaml")
    ppo = load_run_config(REPO / "configs/gsm8k_ppo_qwen2.5_7b.yaml")
    for cfg in (grpo, ppo):
        assert cfg.rollout.backend == "sglang" and cfg.data.train_batch_size == 1024
        assert cfg.learner.optim.lr == 1e-6 and cfg.learner.policy_loss.clip_ratio_low == 0.2
        assert cfg.learner.kl.kl_coef == 0.001 and cfg.learner.kl.kl_ctrl == "adaptive"
    assert grpo.learner.algorithm.adv_estimator == "grpo" and grpo.rollout.n > 1
    assert ppo.learner.algorithm.adv_estimator == "gae"
    assert (ppo.learner.algorithm.gamma, ppo.learner.algorithm.lam) == (0.99, 0.95)
    assert ppo.learner.critic.optim.lr == 1e-5


def test_configuration_reference_is_generated_from_the_code():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render_docs(), "docs/configuration.md is stale: run `make docs`"


def test_the_verl_mapping_page_is_generated_from_the_key_table():
    from launcher.verl.docs import render_verl_docs

    committed = (REPO / "docs" / "verl.md").read_text()
    assert committed == render_verl_docs(), "docs/verl.md is stale: run `make docs`"


def test_every_documented_default_is_the_default_a_fresh_run_config_holds():
    fresh = RunConfig()
    rows = field_docs(RunConfig)
    for key, _type, documented, _meaning in rows:
        value = fresh
        for part in key.split("."):
            value = getattr(value, part)
        assert documented == value, (
            f"{key}: documented {documented!r}, the code's default {value!r}"
        )
    # a section built with other values than its class's defaults (CriticConfig.optim)
    critic_lr = next(row for row in rows if row[0] == "learner.critic.optim.lr")
    assert critic_lr[2] == fresh.learner.critic.optim.lr == 1e-5
    assert "| `learner.critic.optim.lr` | float (>0) | `1e-05` |" in render_docs()


def test_run_groups_per_version_is_the_buffers_rule_a_batch_per_step_times_steps_per_version():
    from buffer.admission import derive_groups_per_version

    assert derive_groups_per_version(16, 2) == 32
    cfg = RunConfig()
    expected = derive_groups_per_version(cfg.data.train_batch_size, cfg.weight_sync.sync_every)
    assert cfg.groups_per_version == expected
