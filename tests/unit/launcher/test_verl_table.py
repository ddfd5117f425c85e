"""fleetrl's verl key table against verl's own defaults (tests/data/verl, vendored from verl):
every key of verl's ppo_trainer config is mapped, noted as having no effect, or refused, with
verl's default; and the default file translates, key by key, to what verl means."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from fleetrl.config import _type_at
from launcher.config import RunConfig
from launcher.verl.load import TABLE, flatten, load_verl
from launcher.verl.table import MANDATORY, NO_DEFAULT
from launcher.verl.translate import VerlRefused

VERL_DEFAULTS = Path(__file__).resolve().parents[2] / "data/verl/ppo_trainer_generated.yaml"


@pytest.fixture(scope="module")
def verl_file() -> dict:
    return yaml.safe_load(VERL_DEFAULTS.read_text())


@pytest.fixture(scope="module")
def leaves(verl_file) -> dict:
    return dict(flatten(verl_file))


def test_every_key_of_verls_defaults_has_an_entry_with_verls_default(verl_file, leaves):
    assert len(leaves) > 500
    missing = [path for path in leaves if TABLE.lookup(path) is None]
    assert missing == []
    for path, value in leaves.items():
        key = TABLE.lookup(path)
        if not key.is_pattern:
            assert key.default == value, f"{path}: table says {key.default!r}, verl {value!r}"
    # resolved as verl resolves them, verl's defaults are accepted (but the mandatory ???)
    resolved = dict(flatten(OmegaConf.to_container(OmegaConf.create(verl_file), resolve=True)))
    for path, value in resolved.items():
        key = TABLE.lookup(path)
        assert key.accepts(value) or value == MANDATORY, f"{path}: verl's default {value!r} refused"


def test_the_table_names_no_key_verl_does_not_have_unless_marked_from_an_older_release(leaves):
    for key in TABLE.keys:
        if key.is_pattern:
            assert any(TABLE.lookup(p) is key for p in leaves) or key.path == "**._target_" or key.legacy, key.path  # fmt: skip
        elif key.legacy or key.plus:
            assert key.path not in leaves, f"{key.path} is in verl's current defaults"
        else:
            assert key.path in leaves, f"{key.path} is not a key of verl's defaults"
            assert key.default is not NO_DEFAULT


def test_every_entry_says_what_it_sets_or_why_it_has_no_effect():
    for key in TABLE.keys:
        if key.kind == "note":
            assert key.why, key.path
        else:
            targets = [t.strip() for t in key.to.split(",")]
            for target in targets:
                assert _type_at(RunConfig, target) is not None, f"{key.path} -> {target}: no such fleetrl key"  # fmt: skip
        if key.accept is not None:
            assert key.fix, f"{key.path} refuses values but says not what to set"


def test_verls_default_file_is_refused_only_where_verl_itself_needs_a_value(verl_file):
    # verl's ppo_trainer.yaml cannot run as it is either: rollout.name is ??? (mandatory)
    with pytest.raises(VerlRefused) as refused:
        load_verl(verl_file, [])
    assert len(refused.value.lines) == 1
    assert "actor_rollout_ref.rollout.name: got '???'; set sglang" in refused.value.lines[0]
    # ... and without dynamic batching verl requires a micro-batch size
    with pytest.raises(VerlRefused, match=r"ppo_micro_batch_size_per_gpu: got None"):
        load_verl(verl_file, ["actor_rollout_ref.rollout.name=sglang"])


def test_verls_defaults_translate_key_by_key_to_what_verl_means(verl_file, leaves):
    loaded = load_verl(
        verl_file,
        [
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        ],
    )
    for path in leaves:  # each direct key set its fleetrl key, from itself
        key = TABLE.lookup(path)
        if key.kind == "map":
            assert loaded.translation.settings[key.to].source == path
    cfg = loaded.run_config()
    lr, cr = cfg.learner, cfg.rollout
    assert lr.algorithm.adv_estimator == "gae" and lr.critic.enabled == "auto"  # PPO with a critic
    assert cr.n == 1 and not lr.use_dynamic_bsz and lr.grad_checkpointing and lr.packing
    assert lr.optim.lr == 1e-6 and lr.critic.optim.lr == 1e-5 and lr.micro_batch_size == 4
    assert (lr.policy_loss.clip_ratio_low, lr.policy_loss.clip_ratio_high) == (0.2, 0.2)
    assert cfg.data.train_batch_size == 1024 and cr.max_new_tokens == 512
    assert cfg.data.truncation == "error" and cfg.data.max_prompt_length == 512
    tr = cfg.trainer
    assert tr.save_freq == 0 and tr.test_freq == -1 and tr.val_before_train  # -1: never saves
    assert tr.total_epochs == 30 and tr.output_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.buffer.max_staleness == 0  # verl's trainer is synchronous
    # 8 GPUs, engines of tensor_model_parallel_size 2: half to each side
    assert (lr.num_ranks, lr.gpus_per_rank, cr.num_engines, cr.gpus_per_engine) == (4, 1.0, 2, 2.0)
    assert cr.mem_fraction_static == 0.5 and cr.backend == "sglang"
    assert cfg.logging.wandb and not cfg.logging.mlflow and cfg.logging.project == "verl_examples"
    assert cfg.model.dtype == "bfloat16" and cfg.model.path.endswith("models/deepseek-llm-7b-chat")
    assert "~" not in cfg.model.path and "~" not in cfg.data.train_files[0]
