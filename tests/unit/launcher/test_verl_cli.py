"""A verl user's PPO job on the command line, as verl's SkyPilot deployment guide runs it
(tests/data/verl/skypilot_ppo_overrides.txt), given to fleetrl as it is: as dotted overrides
and as a verl YAML file. vLLM is refused in one line naming the key and SGLang; with SGLang,
`fleetrl config show` prints the fleetrl config verl's semantics imply, and `fleetrl check`
lists what this machine lacks, each line naming the verl key it comes from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetrl.config import parse_override

GUIDE = Path(__file__).resolve().parents[2] / "data/verl/skypilot_ppo_overrides.txt"
SGLANG = "actor_rollout_ref.rollout.name=sglang"


def guide_overrides() -> list[str]:
    lines = GUIDE.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def as_verl_yaml(overrides: list[str], path: Path) -> Path:
    tree: dict = {}
    for item in overrides:
        parts, value = parse_override(item)
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def fleetrl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "RAY_"))}
    env.update(HOME=str(tmp_path), FLEETRL_LOG_LEVEL="INFO")
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture
def guide_file(tmp_path) -> Path:
    return as_verl_yaml(guide_overrides(), tmp_path / "verl_ppo.yaml")


@pytest.mark.parametrize("form", ["overrides", "file"])
def test_the_guides_vllm_job_is_refused_in_one_line_naming_the_rollout_key_and_sglang(
    tmp_path, guide_file, form
):
    args = guide_overrides() if form == "overrides" else ["--config", str(guide_file)]
    result = fleetrl(tmp_path, "check", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "fleetrl: verl key actor_rollout_ref.rollout.name: got 'vllm'; set sglang (fleetrl's "
        "rollout engines are SGLang servers; vLLM, HF and TensorRT-LLM rollouts are not supported)"
    ]


def test_with_sglang_config_show_prints_the_fleetrl_config_verls_semantics_imply(
    tmp_path, guide_file
):
    result = fleetrl(tmp_path, "config", "show", "--config", str(guide_file), SGLANG)
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    home = str(tmp_path)
    assert cfg["data"]["train_files"] == [f"{home}/data/gsm8k/train.parquet"]
    assert (cfg["data"]["train_batch_size"], cfg["data"]["max_prompt_length"]) == (256, 512)
    assert cfg["data"]["truncation"] == "error"  # verl's default: an over-long prompt is an error
    assert cfg["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    ro, lr = cfg["rollout"], cfg["learner"]
    assert (ro["backend"], ro["n"], ro["max_new_tokens"], ro["mem_fraction_static"]) == (
        "sglang", 1, 256, 0.4,
    )  # fmt: skip
    assert lr["algorithm"]["adv_estimator"] == "gae"  # verl's default: PPO with a critic
    assert (lr["optim"]["lr"], lr["critic"]["optim"]["lr"]) == (1e-6, 1e-5)
    assert (lr["ppo_mini_batch_size"], lr["micro_batch_size"], lr["use_dynamic_bsz"]) == (64, 4, False)  # fmt: skip
    assert lr["kl"]["kl_coef"] == 0.001 and lr["grad_checkpointing"] is True
    # 1 GPU x 2 nodes, engines of tensor_model_parallel_size 1: one learner rank, one engine
    assert (lr["num_ranks"], lr["gpus_per_rank"], ro["num_engines"], ro["gpus_per_engine"]) == (1, 1.0, 1, 1.0)  # fmt: skip
    tr = cfg["trainer"]
    assert (tr["save_freq"], tr["test_freq"], tr["val_before_train"], tr["total_epochs"]) == (20, 20, False, 2)  # fmt: skip
    assert tr["output_dir"] == "checkpoints/verl_examples/experiment_name_gsm8k"
    assert cfg["logging"]["wandb"] is True and cfg["logging"]["run_name"] == "experiment_name_gsm8k"
    assert cfg["buffer"]["max_staleness"] == 0  # verl's trainer is synchronous
    # the notes: named once on stderr, with the split of the GPUs
    assert "GPUs: verl's 2 (1 x 2) go 1 to learner ranks, 1 to 1 SGLang engine(s)" in result.stderr
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 has no effect" in result.stderr  # fmt: skip
    assert result.stderr.count("log_prob_micro_batch_size_per_gpu=8") == 1
    # the step count waits for the data (not on this machine): said in the output
    assert "# trainer.total_steps is counted from data.train_files when the run starts" in result.stdout  # fmt: skip


def test_with_sglang_fleetrl_check_lists_what_this_machine_lacks_by_verl_key(tmp_path):
    result = fleetrl(tmp_path, "check", *guide_overrides(), SGLANG)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("fleetrl: preflight")]
    text = "\n".join(lines)
    for expected in (
        "at data.train_files: file not found",
        f"at actor_rollout_ref.model.path (fleetrl model.path): {tmp_path}/Qwen/Qwen2.5-0.5B-Instruct is not a Hugging Face model folder",  # fmt: skip
        "at actor_rollout_ref.rollout.name (fleetrl rollout.backend): SGLang engines need CUDA",
        "at actor_rollout_ref.rollout.tensor_model_parallel_size (fleetrl rollout.gpus_per_engine): the rollout fleet needs 1 engine",  # fmt: skip
        "at trainer.n_gpus_per_node, trainer.nnodes (fleetrl learner.gpus_per_rank): the learner group needs 1 rank",  # fmt: skip
        "at trainer.device: cuda, but torch sees no CUDA device",
        "at trainer.logger (fleetrl logging.wandb): no wandb credentials",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"
