"""``fleetrl weights push`` into two running embedded engines: bits, version, failures named."""

from __future__ import annotations

import pytest
import requests
import torch
from safetensors.torch import load_file

from fleetrl.models.tiny import make_tiny_model
from launcher.cli import main as fleetrl_main
from rollout_fleet.engine.server import EmbeddedEngine

pytestmark = pytest.mark.timeout(240)


def test_push_loads_a_model_folder_into_two_engines_bit_for_bit(tiny_model_dir, tmp_path, capsys):
    other = make_tiny_model(tmp_path / "other", layers=2, hidden=64, heads=4, seed=7)
    engines = [EmbeddedEngine(str(tiny_model_dir), engine_id=f"push-{i}") for i in range(2)]
    urls = [e.start_server("127.0.0.1", 0) for e in engines]
    try:
        argv = ["weights", "push", "--model", str(other), "--version", "5", "--bucket-mb", "0.05"]
        for url in urls:
            argv += ["--engine", url]
        assert fleetrl_main(argv) == 0
        assert "pushed version 5" in capsys.readouterr().out
        expected = load_file(str(next(other.glob("*.safetensors"))))
        for url, engine in zip(urls, engines, strict=True):
            assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == "5"
            held = engine.runner.model.state_dict()
            for name, tensor in expected.items():
                assert torch.equal(held[name], tensor.to(held[name].dtype)), name
    finally:
        for engine in engines:
            engine.stop()


def test_push_names_the_engine_that_failed(tiny_model_dir, capsys):
    engine = EmbeddedEngine(str(tiny_model_dir), engine_id="push-ok")
    url = engine.start_server("127.0.0.1", 0)
    dead = "http://127.0.0.1:9"
    try:
        argv = ["weights", "push", "--model", str(tiny_model_dir), "--engine", url]
        argv += ["--engine", dead, "--timeout-s", "10"]
        assert fleetrl_main(argv) == 1
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fleetrl:")]
        assert len(lines) == 1 and lines[0].startswith("fleetrl: weights push failed")
        assert f"engine {dead}:" in lines[0] and f"engine {url}:" not in lines[0]
    finally:
        engine.stop()
