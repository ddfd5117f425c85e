"""Adapter names and folders: the version round-trips, folders are written whole, bad ones named."""

from __future__ import annotations

import json

import pytest
import torch

from weight_sync.adapters import (
    adapter_name,
    adapter_version,
    read_adapter_folder,
    write_adapter_folder,
)

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
KEY = "base_model.model.model.layers.0.self_attn.q_proj"


def test_the_name_carries_the_version():
    assert adapter_version(adapter_name(17)) == 17
    for bad in ("fleetrl-policy-v", "other-v3", "fleetrl-policy-vx"):
        with pytest.raises(ValueError, match="not a fleetrl adapter name"):
            adapter_version(bad)
    with pytest.raises(ValueError):
        adapter_name(-1)


def test_a_written_folder_reads_back_as_the_update_peft_applies(tmp_path):
    a, b = torch.randn(2, 5), torch.randn(3, 2)
    folder, nbytes = write_adapter_folder(
        tmp_path, "x", [(f"{KEY}.lora_A.weight", a), (f"{KEY}.lora_B.weight", b)], CONFIG
    )
    assert nbytes == (a.numel() + b.numel()) * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no temporary folder left
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 2
    weights = read_adapter_folder(folder)
    torch.testing.assert_close(weights.delta("model.layers.0.self_attn.q_proj"), 2.0 * b @ a)


def test_folders_peft_features_we_do_not_apply_are_refused_by_name(tmp_path):
    pair = [(f"{KEY}.lora_A.weight", torch.ones(2, 5)), (f"{KEY}.lora_B.weight", torch.ones(3, 2))]
    extra = [("base_model.model.lm_head.modules_to_save.default.weight", torch.ones(3, 5))]
    write_adapter_folder(tmp_path, "saved", pair + extra, CONFIG)
    with pytest.raises(ValueError, match="modules_to_save"):
        read_adapter_folder(tmp_path / "saved")
    write_adapter_folder(tmp_path, "dora", pair, {**CONFIG, "use_dora": True})
    with pytest.raises(ValueError, match="DoRA"):
        read_adapter_folder(tmp_path / "dora")
    write_adapter_folder(tmp_path, "half", pair[:1], CONFIG)
    with pytest.raises(ValueError, match="without both lora_A and lora_B"):
        read_adapter_folder(tmp_path / "half")
    with pytest.raises(ValueError, match="empty"):
        write_adapter_folder(tmp_path, "none", [], CONFIG)
    assert not (tmp_path / "none").exists()


def test_folders_left_by_an_earlier_run_are_found_oldest_first(tmp_path):
    from weight_sync.adapters import existing_adapter_folders

    for version in (10, 9):
        (tmp_path / adapter_name(version)).mkdir()
    (tmp_path / f".{adapter_name(11)}.tmp-abcd1234").mkdir()  # a writer died mid-write
    (tmp_path / "someone-else").mkdir()
    assert existing_adapter_folders(tmp_path) == [adapter_name(9), adapter_name(10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        adapter_name(10),
        adapter_name(9),
        "someone-else",
    ]
    assert existing_adapter_folders(tmp_path / "missing") == []
