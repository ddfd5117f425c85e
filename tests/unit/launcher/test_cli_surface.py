"""The command line a new user meets: `--version`, every option described, override examples
that each command accepts, errors said once (`fleetrl:`, never `fleetrl: fleetrl eval:`) with
the hint that fixes them, and `check` and `train` without a config reporting the same
problems, all at once."""

from __future__ import annotations

import argparse
import re

import pytest

from launcher.cli import build_parser, main
from launcher.config import load_run_config
from launcher.rm_config import load_rm_config


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, its parser) of every subcommand, at any depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_version_prints_the_installed_version(capsys):
    from fleetrl import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fleetrl {__version__}"


def test_every_option_of_every_command_is_described():
    undescribed = [
        f"fleetrl {' '.join(words)} {action.option_strings or action.dest}"
        for words, parser in _commands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not action.help
    ]
    assert undescribed == []


def test_each_commands_override_example_is_accepted_by_that_command():
    examples = {}
    for words, parser in _commands(build_parser()):
        for action in parser._actions:
            if action.dest == "overrides" and action.help and "e.g." in action.help:
                examples[" ".join(words)] = re.sub(r"^.*e\.g\. ", "", action.help).split()
    assert {"train", "check", "plan", "config show", "rm train", "eval"} <= set(examples)
    assert "rollout.n=8" not in examples["rm train"]
    for command, overrides in examples.items():
        if command == "rm train":
            load_rm_config(None, [*overrides, "data.train_files=[pairs.parquet]"])
        elif command != "config from-verl":
            load_run_config(None, overrides)


def test_eval_errors_are_said_once_with_the_key_that_writes_snapshots(tmp_path, capsys):
    code = main(["eval", "--snapshots", str(tmp_path), "data.val_files=[val.parquet]"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("fleetrl") == 1
    assert err.startswith(f"fleetrl: no policy snapshots under {tmp_path}")
    assert "trainer.save_hf_freq" in err


def test_plan_without_the_models_files_names_model_config(capsys):
    code = main(["plan", "--config", "configs/gsm8k_grpo_qwen2.5_7b.yaml"])
    err = capsys.readouterr().err
    assert code == 2 and "--model-config" in err and len(err.strip().splitlines()) == 1


def test_check_and_train_without_a_config_report_the_same_problems_at_once(tmp_path, capsys):
    args = [f"trainer.output_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}"]
    assert main(["check", *args]) == 2
    check = capsys.readouterr().err.splitlines()
    assert main(["train", *args]) == 2
    train = capsys.readouterr().err.splitlines()
    assert check == train
    assert check[0].startswith("fleetrl: config error at data.train_files: got []")
    assert check[1].startswith(
        f"fleetrl: preflight error at model.path: {tmp_path / 'model'} is not a Hugging Face "
        "model folder (point it at a local model folder"
    )
    assert not (tmp_path / "run").exists()


def test_every_unknown_key_at_once_with_the_key_it_most_likely_meant(capsys):
    code = main(["config", "show", "learner.optim.lrr=1", "trainer.n=3", "nosuch.x=1"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 3
    assert "learner.optim.lrr: unknown key; did you mean learner.optim.lr?" in lines[0]
    assert "trainer.n: unknown key; did you mean rollout.n?" in lines[1]
    assert "nosuch: unknown key; accepted keys: data, model, rollout" in lines[2]
