"""``fleetrl weights push`` into two engines that run SGLang's own server and weight-update code.

SGLang's ``SchedulerWeightUpdaterManager`` refuses every update outside a
``/begin_weight_update`` .. ``/end_weight_update`` session, so a push that
lands proves every update was inside one; the bits are read back from every
TP rank.
"""

from __future__ import annotations

import pytest
import requests
import torch
from safetensors.torch import load_file

from fleetrl.models.tiny import make_tiny_model
from launcher.cli import main as fleetrl_main

pytestmark = pytest.mark.timeout(600)


def test_push_loads_a_model_into_two_sglang_engines_bit_for_bit(
    sglang_engine_factory, tmp_path, capsys
):
    engines = [sglang_engine_factory(tp_size=1), sglang_engine_factory(tp_size=2)]
    pushed = make_tiny_model(tmp_path / "pushed", layers=2, hidden=64, heads=4, seed=11)
    argv = ["weights", "push", "--model", str(pushed), "--version", "3", "--bucket-mb", "0.05"]
    for engine in engines:
        argv += ["--engine", engine.url]
    assert fleetrl_main(argv) == 0, capsys.readouterr().err[-2000:]
    expected = load_file(str(next(pushed.glob("*.safetensors"))))
    for engine in engines:
        info = requests.get(f"{engine.url}/model_info", timeout=30).json()
        assert info["weight_version"] == "3"
        assert engine.rank_weight_versions() == ["3"] * engine.tp_size
        for held in engine.rank_weights():  # every TP rank
            for name, tensor in expected.items():
                assert torch.equal(held[name], tensor.to(held[name].dtype)), name
