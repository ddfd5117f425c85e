"""The reward-model run config: typed like the RL one, its reused sections limited to the
keys it reads, and bad input refused with one line naming the dotted key (exit 2)."""

from __future__ import annotations

import pytest

from fleetrl.config import ConfigError
from launcher.rm_config import RM_KEYS, RmRunConfig, load_rm_config, placement_config
from tests.unit.launcher.test_config_errors import _cli

BASE = ["data.train_files=[pairs.parquet]"]


@pytest.mark.parametrize(
    ("override", "path", "detail"),
    [
        (
            "learner.kl.use_kl_loss=true",
            "learner.kl",
            "not a key of `fleetrl rm train`; accepted keys: cpus_per_rank, ",
        ),  # fmt: skip
        (
            "trainer.save_hf_freq=5",
            "trainer.save_hf_freq",
            "accepted keys: device, max_bad_steps, ",
        ),
        ("model.warmstart.steps=10", "model.warmstart", "accepted keys: create_tiny, dtype, "),
        (
            "learner.optim.lrr=1e-6",
            "learner.optim.lrr",
            "unknown key; did you mean learner.optim.lr?",
        ),  # fmt: skip
        ("data.max_length=1", "data.max_length", "expected int >= 2"),
        ("data.synth_task=add3", "data.synth_task", "expected one of '', 'add2', 'add2_even'"),
        ("rm.head_init_std=-1", "rm.head_init_std", "expected float >= 0"),
        (
            "rollout.n=8",
            "rollout",
            "unknown key; accepted keys: data, model, rm, learner, trainer, logging, ray",
        ),  # fmt: skip
    ],
)
def test_bad_keys_and_values_are_one_line_naming_the_dotted_path(override, path, detail):
    with pytest.raises(ConfigError) as err:
        load_rm_config(None, [*BASE, override])
    assert str(err.value).startswith(f"config error at {path}: ") and detail in str(err.value)


def test_rm_train_cli_exits_2_with_one_line_for_a_bad_key():
    result = _cli("rm", "train", *BASE, "learner.algorithm.adv_estimator=gae")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[0]] and "Traceback" not in result.stderr
    assert lines[0].startswith("fleetrl: config error at learner.algorithm: not a key of")


def test_without_training_files_or_with_sequence_parallel_the_config_is_refused():
    with pytest.raises(ConfigError, match="data.train_files: give at least one"):
        load_rm_config(None, [])
    with pytest.raises(ConfigError, match="learner.sequence_parallel: not a key of"):
        load_rm_config(None, [*BASE, "learner.sequence_parallel=2"])


def test_every_allowed_key_exists_in_its_section_and_placement_sees_no_engines():
    from fleetrl.models.config import ModelConfig
    from launcher.config import TrainerConfig
    from learner.config import LearnerConfig

    for section, struct in (("model", ModelConfig), ("learner", LearnerConfig), ("trainer", TrainerConfig)):  # fmt: skip
        assert RM_KEYS[section] <= set(struct.__struct_fields__), section
    cfg = load_rm_config(None, [*BASE, "learner.num_ranks=3", "learner.cpus_per_rank=2"])
    assert isinstance(cfg, RmRunConfig)
    from launcher.placement import requested_cpus

    assert requested_cpus(placement_config(cfg)) == 6.0  # the ranks' CPUs, no engine's
