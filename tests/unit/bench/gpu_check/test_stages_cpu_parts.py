"""Pieces of the GPU check's stages that need no stage process: the learner's FLOP count,
the CUDA-IPC protocol's CPU stand-in, the demo's metrics, the accuracy stage's sizes and
base config, the datasheet peaks, and the co-located hook's loading."""

from __future__ import annotations

import json

import pytest

from bench.gpu import accuracy, demo, ipc, machine
from bench.gpu.learner import SIZES as LEARNER_SIZES
from bench.gpu.learner import train_flops
from bench.gpu.stage import CheckFailed
from bench.gpu.weight_sync import load_colocated_push
from learner.memory import ModelShape


def shape(**changes) -> ModelShape:
    base = dict(vocab=100, hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4,
                intermediate=16, tied=True, qkv_bias=True)  # fmt: skip
    return ModelShape(**{**base, **changes})


def test_train_flops_count_every_matrix_product_forward_and_backward_plus_causal_attention():
    s = shape()
    # per block: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8 = 64+32+32+64+128+128+128
    per_block = 576
    matrix = 2 * per_block + 100 * 8  # the LM head counts though tied to the embedding
    attention = 2 * 2 * 4  # layers x heads x head_dim
    expected = 6 * matrix * 3 + 6 * attention * 9 + 6 * matrix * 5 + 6 * attention * 25
    assert train_flops(s, [3, 5]) == expected


def test_the_cuda_learner_is_qwen2_5_0_5b_shaped_at_about_half_a_billion_parameters():
    sizes = LEARNER_SIZES["cuda"]
    qwen = shape(vocab=sizes.vocab, hidden=sizes.hidden, layers=sizes.layers, heads=sizes.heads,
                 kv_heads=sizes.kv_heads, head_dim=sizes.hidden // sizes.heads,
                 intermediate=sizes.intermediate)  # fmt: skip
    assert 0.45e9 < qwen.params() < 0.55e9  # Qwen2.5-0.5B: 494 M
    assert train_flops(qwen, [1]) / 6 == pytest.approx(
        qwen.params() - qwen.hidden * (2 * qwen.layers + 1), rel=0.01
    )


def test_the_h200_peak_is_the_datasheets_dense_bf16_figure_and_others_get_none():
    peak, source = machine.datasheet_peak("NVIDIA H200")
    assert peak == 989.5e12 and "datasheet" in source and "989.5 dense" in source
    assert machine.datasheet_peak("NVIDIA A10G") == (None, "no datasheet figure for 'NVIDIA A10G'")


def test_the_ipc_protocol_delivers_the_producers_bytes_to_another_process():
    figures = ipc.measure("cpu", 1 << 20, reps=2)
    assert figures["checksum_matches"] is True and figures["bytes"] == 1 << 20
    assert figures["ipc_copy_gbps"] > 0 and figures["local_copy_gbps"] > 0
    assert figures["transport"].startswith("shared_memory_file")


def test_the_ipc_checksum_tells_different_buffers_apart():
    import torch

    a = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    b = a.clone()
    b[ipc.CHECK_STRIDE * 3] ^= 1
    assert ipc.checksum(a) == ipc.checksum(a.clone()) != ipc.checksum(b)


def test_demo_figures_read_steps_losses_memory_and_scores_from_metrics_rows(tmp_path):
    rows = [
        {"step": 0, "val/score/mean": 0.1},
        {"step": 1, "actor/pg_loss": 0.5, "timing_s/step": 1.5, "perf/peak_memory_gb": 2.0,
         "plan/learner_gb": 1.8, "perf/total_num_tokens": 500.0, "perf/samples_per_s": 30.0},
        {"step": 2, "actor/pg_loss": -0.25, "timing_s/step": 0.5, "perf/peak_memory_gb": 2.5,
         "plan/learner_gb": 1.8, "perf/total_num_tokens": 512.0, "perf/samples_per_s": 50.0,
         "val/score/mean": 0.3},
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"torn": ')
    figures = demo.metrics_figures(demo.read_rows(path))
    assert figures["steps"] == 2 and figures["pg_losses"] == [0.5, -0.25]
    assert figures["step_s_median"] == 1.0 and figures["tokens_per_step"] == 512.0
    assert figures["samples_per_s"] == 40.0
    assert figures["peak_gib"] == 2.5 and figures["plan_learner_gib"] == 1.8
    assert figures["val_scores"] == [0.1, 0.3]


def test_the_demo_overrides_put_every_path_in_the_stages_folder(tmp_path):
    from launcher.config import load_run_config

    for device in ("cuda", "cpu"):
        cfg = load_run_config(demo.CONFIG, demo.overrides(tmp_path, device))
        assert cfg.trainer.total_steps == demo.STEPS and cfg.trainer.device == device
        assert cfg.trainer.output_dir.startswith(str(tmp_path))
        assert cfg.model.path.startswith(str(tmp_path))
        assert all(f.startswith(str(tmp_path)) for f in cfg.data.train_files + cfg.data.val_files)
    cuda = load_run_config(demo.CONFIG, demo.overrides(tmp_path, "cuda"))
    assert (cuda.learner.gpus_per_rank, cuda.rollout.gpus_per_engine) == (0.5, 0.5)
    assert cuda.weight_sync.backend == "gloo" and cuda.model.dtype == "bfloat16"


def test_the_accuracy_stage_places_the_suites_workload_on_one_gpu(tmp_path):
    from launcher.config import load_run_config

    cfg = load_run_config(accuracy.base_config("cuda", tmp_path), [])
    assert cfg.trainer.device == "cuda" and cfg.weight_sync.backend == "gloo"
    assert (cfg.learner.gpus_per_rank, cfg.rollout.gpus_per_engine, cfg.ray.num_gpus) == (
        0.5,
        0.5,
        1,
    )
    plain = load_run_config(accuracy.BASE_CONFIG, [])
    assert cfg.data == plain.data and cfg.model.tiny == plain.model.tiny  # the same workload
    assert accuracy.base_config("cpu", tmp_path) == accuracy.BASE_CONFIG
    cuda = accuracy.sizes_for("cuda")
    assert cuda.seeds == (0,) and cuda.workload.device == "cuda"
    assert cuda.target_score == accuracy.sizes_for("cpu").target_score


def test_the_colocated_hook_is_loaded_by_name_and_a_bad_name_says_what_is_wrong():
    assert load_colocated_push("json:dumps") is json.dumps
    with pytest.raises(CheckFailed, match="expected MODULE:FUNCTION"):
        load_colocated_push("json")
    with pytest.raises(CheckFailed, match="json has no nothing_here"):
        load_colocated_push("json:nothing_here")
