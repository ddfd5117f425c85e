"""data.train_files / val_files: one path or a list, `~` expanded (verl accepts both forms)."""

from __future__ import annotations

import os

import pytest

from fleetrl.config import ConfigError
from launcher.config import load_run_config


def test_a_single_path_with_a_tilde_is_a_list_of_its_expansion():
    cfg = load_run_config(
        None, ["data.train_files=~/data/gsm8k/train.parquet", "data.val_files=[~/v.parquet]"]
    )
    home = os.path.expanduser("~")
    assert cfg.data.train_files == [f"{home}/data/gsm8k/train.parquet"]
    assert cfg.data.val_files == [f"{home}/v.parquet"]
    assert load_run_config(None, ["data.val_files=''"]).data.val_files == []


def test_a_path_that_is_not_a_string_names_the_key():
    with pytest.raises(ConfigError, match="data.train_files"):
        load_run_config(None, ["data.train_files=3"])
