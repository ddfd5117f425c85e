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


def _lora_checkpoint(model_dir, out):
    """A 1-rank LoRA learner run of 2 steps, checkpointed at ``out``; returns its policy."""
    from tests.integration.learner import lora_procs, procs

    torch.set_num_threads(1)
    overrides = {**lora_procs.LORA, "algorithm": {"adv_estimator": "grpo"}}
    worker = procs.make_worker(str(model_dir), 0, 1, procs.free_port(), overrides)
    try:
        for step in range(2):
            worker.step(procs.make_batch(step), policy_version=step)
        worker.save_checkpoint(out, {"next_step": 2})
    finally:
        worker.close()


def test_push_a_lora_checkpoint_as_an_adapter_into_an_sglang_lora_engine(
    tiny_model_dir, tmp_path, capsys
):
    """--adapter-dir: SGLang's LoRA routes load the checkpoint's adapter under the version's
    name, /model_info reports the version, and requests naming it generate what the
    checkpoint's policy (base + adapter) generates; a model folder is refused with a reason."""
    from learner.export import load_lora_policy
    from tests.conformance.sglang_engine import start_sglang_engine
    from tests.integration.weight_sync.lora_fixtures import greedy_with_logprobs
    from weight_sync.adapters import adapter_name

    _lora_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    engine = start_sglang_engine(tiny_model_dir, tp_size=1, lora_rank=8)
    try:
        argv = ["weights", "push", "--model", str(tmp_path / "ckpt"), "--engine", engine.url]
        argv += ["--version", "5", "--adapter-dir", str(tmp_path / "adapters")]
        assert fleetrl_main(argv) == 0, capsys.readouterr().err[-2000:]
        assert "pushed adapter version 5" in capsys.readouterr().out
        info = requests.get(f"{engine.url}/model_info", headers=engine.headers, timeout=30)
        assert info.json()["weight_version"] == "5"
        prompt = [3, 14, 15, 9, 2, 6]
        reply = requests.post(
            f"{engine.url}/generate",
            json={
                "input_ids": prompt,
                "lora_path": adapter_name(5),
                "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
            },
            headers=engine.headers,
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        policy, _ = load_lora_policy(tmp_path / "ckpt", with_base=True)
        assert reply.json()["output_ids"] == greedy_with_logprobs(policy.eval(), prompt, 5)[0]
    finally:
        engine.stop()
    full = make_tiny_model(tmp_path / "full", layers=2, hidden=64, heads=4, seed=1)
    argv = ["weights", "push", "--model", str(full), "--engine", "http://127.0.0.1:9"]
    assert fleetrl_main([*argv, "--adapter-dir", str(tmp_path / "a")]) == 2
    assert "is a Hugging Face folder (push it without --adapter-dir)" in capsys.readouterr().err
