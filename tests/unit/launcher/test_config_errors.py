"""Config errors: one line naming the dotted path, exit status 2, no traceback; overrides typed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.config import ConfigError
from launcher.config import RunConfig, load_run_config

REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("override", "path", "detail"),
    [
        (
            "learner.optim.lrr=1e-6",
            "learner.optim.lrr",
            "unknown key; did you mean learner.optim.lr?",
        ),  # fmt: skip
        ("learner.optim.zzz=1", "learner.optim.zzz", "unknown key; accepted keys: lr, "),
        ("nosuchsection.x=1", "nosuchsection", "unknown key; accepted keys: data, model, "),
        ("learner.optim.lr=fast", "learner.optim.lr", "got 'fast' (str); expected float"),
        ("rollout.n=0", "rollout.n", "got 0 (int); expected int >= 1"),
        (
            "rollout.backend=trtllm",
            "rollout.backend",
            "expected one of 'embedded', 'sglang', 'vllm'",
        ),
        (
            "rollout.multi_turn.env=calculatr",
            "rollout.multi_turn",
            "env 'calculatr' is neither a built-in environment (calculator) nor",
        ),
        ("rollout.multi_turn.max_turns=0", "rollout.multi_turn.max_turns", "expected int >= 1"),
        (
            "rollout.agent.entrypoint=agent.py",
            "rollout.agent",
            "neither 'path/to/file.py:function'",
        ),
    ],
)
def test_cli_config_error_is_one_line_naming_the_dotted_path(override, path, detail):
    result = _cli("config", "show", override)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[0]] and "Traceback" not in result.stderr
    assert lines[0].startswith(f"fleetrl: config error at {path}: ")
    assert detail in lines[0]


def test_cli_config_show_prints_the_resolved_override():
    result = _cli("config", "show", "learner.optim.lr=1e-6", "rollout.n=8")
    assert result.returncode == 0, result.stderr
    assert "lr: 1.0e-06" in result.stdout and "n: 8" in result.stdout


def test_scientific_notation_override_parses_as_float():
    config = load_run_config(None, ["learner.optim.lr=1e-6", "rollout.temperature=1"])
    assert isinstance(config.learner.optim.lr, float) and config.learner.optim.lr == 1e-6
    assert config.rollout.temperature == 1.0
    assert load_run_config(None, ["learner.optim.lr=2.5E-7"]).learner.optim.lr == 2.5e-7


def test_yaml_values_are_typed_and_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  optim:\n    lr: 3e-4\nrollout:\n  n: 4\n")
    config = load_run_config(path, ["rollout.n=16"])
    assert config.learner.optim.lr == 3e-4
    assert config.rollout.n == 16
    assert isinstance(config, RunConfig)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "path", "fragment"),
    [
        ("rollout:\n  nn: 4\n", [], "rollout.nn", "unknown key"),
        ("rollout:\n  n: four\n", [], "rollout.n", "got 'four' (str); expected int"),
        ("rollout:\n  top_p: 1.5\n", [], "rollout.top_p", "expected float <= 1"),
        ("- a\n- b\n", [], "--config", "must hold a mapping at top level"),
        ("rollout: [unclosed\n", [], "--config", "is not valid YAML"),
        ("", ["rollout.n=4", "rollout.n.x=1"], "rollout.n", "is a int, not a section"),
        ("", ["rollout.n"], "rollout.n", "override must look like dotted.key=value"),
        ("", ["rollout..n=1"], "rollout..n", "empty path component"),
    ],
)
def test_load_run_config_errors_name_the_dotted_path(
    tmp_path, yaml_text, overrides, path, fragment
):
    file = tmp_path / "run.yaml"
    file.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_run_config(file, overrides)
    assert info.value.path == path
    assert str(info.value).startswith(f"config error at {path}: ")
    assert fragment in str(info.value)


def test_missing_config_file_is_named():
    with pytest.raises(
        ConfigError, match=r"config error at --config: file not found: .*absent\.yaml"
    ):
        load_run_config("absent.yaml")


# ---- cross-section rules: checked at load, one line naming both keys, exit 2 ----
@pytest.mark.parametrize(
    ("overrides", "key", "other", "fragment"),
    [
        (
            ["buffer.capacity_groups=4", "data.train_batch_size=16"],
            "buffer.capacity_groups",
            "data.train_batch_size",
            "got 4 < 16 groups; the buffer blocks producers",
        ),
        (
            ["learner.algorithm.adv_estimator=gae", "learner.critic.enabled=off"],
            "learner.critic.enabled",
            "learner.algorithm.adv_estimator",
            "got 'off' with 'gae'; GAE needs value estimates",
        ),
        (
            ["model.create_tiny=true", "model.tiny.max_positions=64", "rollout.max_new_tokens=8"],
            "model.tiny.max_positions",
            "data.max_prompt_length + rollout.max_new_tokens",
            "got 64 < 512 + 8",
        ),
        (
            ["weight_sync.backend=nccl", "trainer.device=cpu"],
            "weight_sync.backend",
            "trainer.device",
            "NCCL broadcasts CUDA tensors only",
        ),
        (
            ["rollout.backend=sglang", "trainer.device=cpu"],
            "rollout.backend",
            "trainer.device",
            "SGLang servers run on GPUs",
        ),
        (
            ["rollout.backend=sglang", "rollout.gpus_per_engine=0"],
            "rollout.gpus_per_engine",
            "rollout.backend",
            "needs a GPU share",
        ),
        (
            ["rollout.backend=vllm", "trainer.device=cpu"],
            "rollout.backend",
            "trainer.device",
            "vLLM servers run on GPUs",
        ),
        (
            [
                "rollout.backend=vllm",
                "rollout.gpus_per_engine=1",
                "learner.gpus_per_rank=1",
                "rollout.placement=colocated",
            ],
            "rollout.placement",
            "rollout.backend",
            "which fleetrl does not do with vLLM; use rollout.placement=disaggregated with vLLM "
            "(or rollout.backend=sglang)",
        ),  # fmt: skip
        (
            [
                "rollout.backend=vllm",
                "rollout.gpus_per_engine=1",
                "learner.gpus_per_rank=1",
                "weight_sync.backend=gloo",
            ],
            "weight_sync.backend",
            "rollout.backend",
            "vLLM's workers receive weights over nccl only",
        ),  # fmt: skip
        (
            ["rollout.backend=vllm", "rollout.gpus_per_engine=1", "learner.gpus_per_rank=0"],
            "learner.gpus_per_rank",
            "rollout.backend",
            "from a learner on a GPU",
        ),
        (
            ["reward.model.path=/rm", "reward.model.backend=sglang"],
            "reward.model.gpus_per_engine",
            "reward.model.backend",
            "an SGLang reward server runs on a GPU",
        ),
        (
            ["trainer.device=cuda"],
            "learner.gpus_per_rank",
            "trainer.device",
            "no GPU to a learner rank",
        ),
        (
            ["buffer.filter_equal_scores=yes", "rollout.n=1"],
            "buffer.filter_equal_scores",
            "rollout.n",
            "all are dropped",
        ),
        (
            ["learner.correction.mode=token_mis", "learner.correction.is_low=2.0"],
            "learner.correction.is_low",
            "learner.correction.is_high",
            "every token would be masked",
        ),
        (
            ["rollout.multi_turn.env=calculator", "data.apply_chat_template=false"],
            "rollout.multi_turn.env",
            "data.apply_chat_template",
            "the prompt must be chat-rendered too",
        ),
        (
            ["rollout.agent.entrypoint=my_agent:run", "rollout.multi_turn.env=calculator"],
            "rollout.agent.entrypoint",
            "rollout.multi_turn.env",
            "an episode is the agent's conversation",
        ),
        (
            ["rollout.agent.entrypoint=my_agent:run", "data.apply_chat_template=false"],
            "rollout.agent.entrypoint",
            "data.apply_chat_template",
            "renders every call with the chat template",
        ),
        (
            ["reward.rule_weight=0"],
            "reward.rule_weight",
            "reward.model",
            "every reward would be 0",
        ),
        (
            ["reward.model.urls=[http://127.0.0.1:30010]"],
            "reward.model.path",
            "reward.model.urls",
            "its own tokenizer and chat template",
        ),
        (
            ["reward.custom_function.data_sources=[mine/*]"],
            "reward.custom_function.data_sources",
            "reward.custom_function.path",
            "need the function",
        ),
        (
            ["rollout.placement=colocated", "rollout.num_engines=2"],
            "rollout.num_engines",
            "learner.num_ranks",
            "one engine on each learner device",
        ),
        (
            [
                "rollout.placement=colocated",
                "rollout.num_engines=2",
                "rollout.colocate.remote_engines=2",
            ],
            "rollout.num_engines",
            "learner.num_ranks",
            "set rollout.num_engines=3",
        ),
        (
            [
                "rollout.placement=colocated",
                "rollout.backend=sglang",
                "rollout.gpus_per_engine=2",
                "trainer.device=cuda",
                "learner.gpus_per_rank=1",
            ],
            "rollout.gpus_per_engine",
            "rollout.placement",
            "co-located engines are one device each",
        ),
        (
            ["rollout.placement=colocated", "trainer.device=cuda", "learner.gpus_per_rank=2"],
            "learner.gpus_per_rank",
            "rollout.placement",
            "share exactly one device",
        ),
        (
            ["rollout.placement=colocated", "rollout.colocate.release=[weights]"],
            "rollout.colocate.release",
            "rollout.placement",
            "add kv_cache",
        ),
        (
            ["rollout.placement=colocated", "weight_sync.sync_every=2"],
            "weight_sync.sync_every",
            "rollout.placement",
            "take it back with the publish that follows it",
        ),
        (
            ["rollout.placement=colocated", "learner.lora.rank=8"],
            "learner.lora.rank",
            "rollout.placement",
            "sends adapters only",
        ),
        (
            [
                "rollout.elastic=true",
                "rollout.num_engines=2",
                "rollout.min_engines=3",
                "rollout.max_engines=4",
            ],  # fmt: skip
            "rollout.min_engines",
            "rollout.num_engines",
            "set rollout.min_engines <= 2",
        ),
        (
            ["rollout.elastic=true", "rollout.num_engines=2", "rollout.max_engines=1"],
            "rollout.max_engines",
            "rollout.num_engines",
            "set rollout.max_engines >= 2",
        ),
        (
            ["rollout.max_engines=3"],
            "rollout.max_engines",
            "rollout.elastic",
            "needs rollout.elastic=true",
        ),
        (
            [
                "rollout.elastic=true",
                "reward.model.path=/rm",
                "reward.model.num_engines=2",
                "reward.model.min_engines=3",
            ],  # fmt: skip
            "reward.model.min_engines",
            "reward.model.num_engines",
            "set reward.model.min_engines <= 2",
        ),
        (
            ["reward.model.max_engines=2"],
            "reward.model.max_engines",
            "reward.model.path",
            "only a reward fleet the run places",
        ),
        (
            ["rollout.elastic=true", "rollout.placement=colocated"],
            "rollout.elastic",
            "rollout.placement",
            "their number is the learner's",
        ),
    ],
)
def test_cross_section_rule_refused_at_load_naming_both_keys(overrides, key, other, fragment):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, overrides)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"config error at {key} (with {other}): got ")
    assert fragment in line


def test_a_custom_reward_pattern_with_a_star_inside_is_refused_naming_its_index():
    with pytest.raises(ConfigError) as info:
        load_run_config(
            None,
            ["reward.custom_function.path=r.py", "reward.custom_function.data_sources=[a,b*c]"],
        )
    assert str(info.value).startswith(
        "config error at reward.custom_function.data_sources[1]: got 'b*c'"
    )


def test_cli_refuses_a_stalling_config_with_exit_2_and_one_line():
    result = _cli("config", "show", "buffer.capacity_groups=4", "data.train_batch_size=16")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith(
        "fleetrl: config error at buffer.capacity_groups (with data.train_batch_size): "
    )


def test_training_needs_train_files_but_config_show_does_not():
    assert load_run_config(None, []).data.train_files == []
    with pytest.raises(ConfigError, match=r"^config error at data.train_files: got \[\]"):
        load_run_config(None, [], training=True)


@pytest.mark.parametrize("word", ["off", "OFF", "no", "false"])
def test_on_off_words_are_accepted_as_yaml_writes_them(tmp_path, word):
    path = tmp_path / "run.yaml"
    path.write_text(f"learner:\n  critic:\n    enabled: {word}\nlogging:\n  wandb: '{word}'\n")
    cfg = load_run_config(path)
    assert cfg.learner.critic.enabled == "off"
    assert cfg.logging.wandb is False
    cfg = load_run_config(None, ["learner.critic.enabled=on", "buffer.filter_truncated=yes"])
    assert cfg.learner.critic.enabled == "on" and cfg.buffer.filter_truncated is True


def test_a_word_that_is_no_switch_is_still_refused():
    with pytest.raises(ConfigError, match="config error at logging.wandb: got 'maybe'"):
        load_run_config(None, ["logging.wandb=maybe"])
