"""fleetrl's WeightSender against SGLang's own server and weight-update code.

The engines here run SGLang 0.5.23's HTTP app, its tokenizer-side control code,
and per TP rank its ``SchedulerWeightUpdaterManager`` (the begin..end session
rule) and ``WeightUpdater`` (``init_custom_process_group``,
``FlattenedTensorBucket``): see ``sglang_engine``. What passes here is what a
GPU run's first weight sync needs: the rendezvous, the session, TP ranks, the
version in ``/model_info``, verification through SGLang's routes.
"""

from __future__ import annotations

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from launcher.config import load_run_config
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import EngineEndpoint, WeightSender
from weight_sync.sources import module_named_tensors

pytestmark = pytest.mark.timeout(600)


def learner_tensors(model_dir, shift: float) -> list[tuple[str, torch.Tensor]]:
    """The tiny model as the learner would publish it, every value moved by ``shift``."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(shift)
    return [(n, t.detach().clone()) for n, t in module_named_tensors(model)]


def assert_every_rank_holds(engine, sent: list[tuple[str, torch.Tensor]], version: int) -> None:
    info = requests.get(f"{engine.url}/model_info", headers=engine.headers, timeout=30).json()
    assert info["weight_version"] == str(version)
    for rank, held in enumerate(engine.rank_weights()):
        for name, tensor in sent:
            assert torch.equal(held[name], tensor), (rank, name)


@pytest.mark.parametrize("load_format", ["flattened_bucket", "per_tensor"])
@pytest.mark.parametrize("pause_mode", ["in_place", "abort", "retract"])
def test_sender_publishes_versions_to_tp1_and_tp2_engines_bit_for_bit(
    sglang_engine, sglang_engine_tp2, tiny_model_dir, load_format, pause_mode
):
    config = WeightSyncConfig(
        backend="gloo",
        bucket_mb=0.05,  # several buckets per version
        pause_mode=pause_mode,
        load_format=load_format,
        timeout_s=60,
        verify_tensors=1000,
        verify_rows=1000,
    )
    endpoints = [
        EngineEndpoint("tp1", sglang_engine.url, sglang_engine.api_key, world_size=1),
        EngineEndpoint("tp2", sglang_engine_tp2.url, None, world_size=2),
    ]
    with WeightSender(config) as sender:
        sender.connect(endpoints)
        for version in (1, 2):
            sent = learner_tensors(tiny_model_dir, 0.01 * version)
            metrics = sender.publish(iter(sent), version)
            assert metrics.num_buckets > (1 if load_format == "flattened_bucket" else 0)
            assert all(s.ok and s.verified for s in metrics.engines.values())
            for engine in (sglang_engine, sglang_engine_tp2):
                assert_every_rank_holds(engine, sent, version)


def test_shipped_gpu_config_weight_sync_runs_with_its_defaults(
    sglang_engine_factory, tiny_model_dir
):
    """configs/gsm8k_grpo_qwen2.5_7b.yaml as shipped (verify on, in_place, its bucket size,
    gpus_per_engine 2 = TP 2), only the backend on gloo because this machine has no GPU."""
    cfg = load_run_config("configs/gsm8k_grpo_qwen2.5_7b.yaml", [])
    assert cfg.rollout.backend == "sglang" and cfg.rollout.tp_size == 2
    assert cfg.weight_sync.verify
    engines = [sglang_engine_factory(tp_size=cfg.rollout.tp_size) for _ in range(2)]
    import msgspec

    config = msgspec.structs.replace(cfg.weight_sync, backend="gloo")
    endpoints = [
        EngineEndpoint(f"engine-{i}", e.url, None, world_size=cfg.rollout.tp_size)
        for i, e in enumerate(engines)
    ]
    with WeightSender(config) as sender:
        sender.connect(endpoints)
        for version in (0, 1):
            sent = learner_tensors(tiny_model_dir, 0.02 * version)
            metrics = sender.publish(iter(sent), version)
            assert all(s.ok and s.verified for s in metrics.engines.values())
            for engine in engines:
                assert_every_rank_holds(engine, sent, version)
