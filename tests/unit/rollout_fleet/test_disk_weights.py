"""``read_checkpoint``: a folder's safetensors, refused when it would leave the model half old."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from rollout_fleet.engine.disk_weights import read_checkpoint
from rollout_fleet.engine.runner import WeightLoadError


def served_weights() -> dict[str, torch.Tensor]:
    embed = torch.zeros(4, 2)
    return {"embed.weight": embed, "head.weight": embed, "norm.weight": torch.ones(2)}  # tied


def test_reads_every_tensor_and_a_tied_weight_counts_as_present(tmp_path):
    save_file({"embed.weight": torch.ones(4, 2)}, str(tmp_path / "a.safetensors"))
    save_file({"norm.weight": torch.full((2,), 3.0)}, str(tmp_path / "b.safetensors"))
    got = dict(read_checkpoint(tmp_path, served_weights()))
    assert set(got) == {"embed.weight", "norm.weight"}  # head.weight shares embed's storage
    assert torch.equal(got["norm.weight"], torch.full((2,), 3.0))


def test_a_folder_missing_a_served_weight_is_refused_naming_it(tmp_path):
    save_file({"norm.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"lacks 2 .*'embed.weight'.*mix of two checkpoints"):
        read_checkpoint(tmp_path, served_weights())


def test_a_tensor_in_two_files_is_refused(tmp_path):
    for name in ("a", "b"):
        save_file({"norm.weight": torch.ones(2)}, str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(WeightLoadError, match="more than one file"):
        read_checkpoint(tmp_path, {"norm.weight": torch.ones(2)})


def test_no_folder_or_no_safetensors_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        read_checkpoint(tmp_path / "absent", served_weights())
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        read_checkpoint(tmp_path, served_weights())
