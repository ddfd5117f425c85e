"""Reading a verl file: layout detection, Hydra overlays and interpolations, verl overrides
beside fleetrl ones, notes named once, errors named by verl key, and `config from-verl`."""

from __future__ import annotations

import argparse
import logging

import pytest
import yaml

from fleetrl.config import ConfigError
from launcher.config import load_run_config
from launcher.verl.from_verl import main as from_verl
from launcher.verl.load import is_verl_layout, load_verl

BASE = {
    "defaults": ["ppo_trainer", "_self_"],
    "actor_rollout_ref": {
        "model": {"path": "/models/policy"},
        "actor": {"ppo_micro_batch_size_per_gpu": 2, "optim": {"lr": 3e-6}},
        "rollout": {
            "name": "sglang",
            "n": 4,
            "engine_kwargs": {"sglang": {"attention_backend": "fa3"}},
        },  # fmt: skip
    },
    "critic": {"model": {"path": "${actor_rollout_ref.model.path}"}},
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"n_gpus_per_node": 4, "default_local_dir": "${oc.env:RUN_ROOT,/runs}/grpo"},
    "hydra": {"run": {"dir": "outputs"}},
}


def _write(tmp_path, tree) -> str:
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return str(path)


def test_a_hydra_overlay_with_interpolations_reads_as_verl_resolves_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RUN_ROOT", str(tmp_path / "root"))
    cfg = load_run_config(_write(tmp_path, BASE))
    assert cfg.trainer.output_dir == f"{tmp_path}/root/grpo"  # ${oc.env:...}
    assert cfg.learner.critic.model_path == ""  # ${actor_rollout_ref.model.path}: the same model
    assert cfg.learner.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 4
    assert cfg.rollout.sglang_extra_args == ["--attention-backend", "fa3"]
    assert cfg.learner.optim.lr == 3e-6


def test_verl_overrides_and_fleetrl_keys_beside_them_apply_last(tmp_path):
    tree = {**BASE, "fleetrl": {"buffer": {"max_staleness": 2}, "learner": {"num_ranks": 3}}}
    cfg = load_run_config(
        _write(tmp_path, tree),
        [
            "actor_rollout_ref.actor.optim.lr=2e-6",
            "+trainer.critic_warmup=1",
            "trainer.output_dir=/x",
            "rollout.num_engines=1",
        ],  # fmt: skip
    )
    assert cfg.learner.optim.lr == 2e-6  # the dotted verl override
    assert cfg.buffer.max_staleness == 2  # the fleetrl section wins over verl's synchronous 0
    assert (cfg.learner.num_ranks, cfg.rollout.num_engines) == (3, 1)  # the user's split
    assert cfg.trainer.output_dir == "/x"  # a trainer key only fleetrl has


def test_notes_are_named_once_and_the_gpu_split_is_said(tmp_path, caplog):
    tree = {**BASE, "data": {"dataloader_num_workers": 2, "use_shm": False}}
    tree["actor_rollout_ref"] = {**BASE["actor_rollout_ref"], "actor": {**BASE["actor_rollout_ref"]["actor"], "profiler": {"enable": True, "ranks": [0]}}}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="fleetrl"):
        load_run_config(_write(tmp_path, tree))
    text = caplog.text
    assert text.count("data.dataloader_num_workers=2 has no effect here") == 1
    assert "actor_rollout_ref.actor.profiler.** (2 keys set) has no effect here" in text
    assert "1 more key(s) set to verl's default have no effect" in text  # use_shm: false
    assert "GPUs: verl's 4 (4 x 1) go 2 to learner ranks, 2 to 1 SGLang engine(s) of 2" in text
    assert "hydra: has no effect here" in text


def test_a_fleetrl_error_names_the_verl_key_it_came_from(tmp_path):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr \(fleetrl learner\.optim\.lr\): got -1"):  # fmt: skip
        load_run_config(_write(tmp_path, BASE), ["actor_rollout_ref.actor.optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"neither a verl key .* nor a fleetrl one"):
        load_run_config(_write(tmp_path, BASE), ["trainer.no_such_key=1"])


def test_a_file_mixing_the_layouts_is_refused_pointing_at_the_fleetrl_section():
    assert not is_verl_layout({"data": {}, "trainer": {}, "learner": {}}, ["rollout.n=2"])
    assert is_verl_layout({}, ["actor_rollout_ref.rollout.name=sglang"])
    with pytest.raises(ConfigError, match="put the fleetrl keys under a `fleetrl:` section"):
        is_verl_layout({"actor_rollout_ref": {}, "learner": {}}, [])


def test_megatron_config_groups_are_refused():
    with pytest.raises(ConfigError, match="defaults: got .*megatron"):
        load_verl({"defaults": ["ppo_megatron_trainer"], "algorithm": {}}, [])


def test_from_verl_writes_a_commented_fleetrl_file_that_runs_the_same_config(tmp_path):
    source = _write(tmp_path, {**BASE, "fleetrl": {"buffer": {"max_staleness": 2}}})
    out = tmp_path / "fleetrl.yaml"
    args = argparse.Namespace(input=source, overrides=["trainer.total_epochs=5"], out=str(out))
    assert from_verl(args) == 0
    text = out.read_text()
    assert "  lr: 3.0e-06  # actor_rollout_ref.actor.optim.lr" in text
    assert "  max_staleness: 2  # a fleetrl key, given beside the verl ones" in text
    assert "  num_ranks: 2  # trainer.n_gpus_per_node, trainer.nnodes: learner ranks, one GPU each" in text  # fmt: skip
    assert "#   GPUs: verl's 4" in text and "#   hydra: has no effect here" in text
    assert "actor_rollout_ref" not in yaml.safe_load(text)  # a fleetrl file
    written = load_run_config(str(out))
    direct = load_run_config(source, ["trainer.total_epochs=5"])
    assert written == direct
