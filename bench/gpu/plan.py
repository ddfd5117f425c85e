"""The GPU check's stages, in running order, with their time limits per device.

The CUDA limits are sized for one H200 (docs/gpu_check.md) so that every stage fits one
9-minute command (``bench.gpu.check.DEFAULT_BUDGET_S``); a stage repeats its measurements
until its deadline, so a limit is a cap, not a guess at its speed. The CPU limits are for the
2-core machine the project is built on, where ``--device cpu`` runs every stage's code at
tiny sizes. The SGLang stages run only where SGLang and a GPU are (``sglang_skip_reason``), the
vLLM ones where vLLM and a GPU are, or on a CPU against the server ``--vllm-server`` names
(``vllm_skip_reason``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from bench.gpu.stage import StageSpec

SGLANG_STAGE_NAMES = ("sglang_engine", "sglang_logprobs", "sglang_throughput",
                      "sglang_weight_sync", "sglang_demo")  # fmt: skip
VLLM_STAGE_NAMES = ("vllm_engine", "vllm_logprobs", "vllm_throughput", "vllm_weight_sync")

STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec("machine", "bench.gpu.machine", {"cuda": 25, "cpu": 180},
                  doc="versions, the device, and its measured bf16 matmul and copy ceilings",
                  headline=("device", "matmul_tflops", "copy_gbps_read_plus_write",
                            "datasheet_bf16_dense_tflops")),
        StageSpec("learner", "bench.gpu.learner", {"cuda": 60, "cpu": 300},
                  doc="bf16 learner on a ~0.5 B Qwen2-shaped model: tokens/s, MFU, packed vs "
                      "padded, peak memory vs the plan's estimate",
                  headline=("parameters", "tokens_per_s_packed", "tokens_per_s_padded",
                            "packed_vs_padded", "mfu_packed", "tflops_packed",
                            "peak_gib_packed", "plan_learner_gib", "peak_vs_plan_packed")),
        StageSpec("rollout", "bench.gpu.rollout", {"cuda": 65, "cpu": 300},
                  doc="the embedded engine vs transformers generate on the same GRPO groups",
                  headline=("engine_tokens_per_s", "hf_generate_tokens_per_s", "vs_hf_generate",
                            "remote_client_tokens_per_s", "prefill_sharing_speedup")),
        StageSpec("weight_sync", "bench.gpu.weight_sync", {"cuda": 40, "cpu": 300},
                  doc="two processes on one device: gloo through host memory, CUDA IPC, vs a copy",
                  headline=("bytes", "local_copy_gbps", "ipc_copy_gbps", "gloo_bucketed_gbps",
                            "gloo_raw_broadcast_gbps", "gloo_per_param_gbps",
                            "gloo_bucketed_vs_local_copy", "colocated_gbps")),
        StageSpec("colocated", "bench.gpu.colocated", {"cuda": 50, "cpu": 180},
                  doc="one co-located switch: the engine's release and resume, a push by "
                      "CUDA IPC handle, the learner's offload and onload",
                  headline=("bytes_released", "device_bytes_freed", "memory_returned",
                            "release_s", "resume_weights_s", "push_s", "push_gbps",
                            "resume_kv_s", "switch_s", "ipc_ok", "learner_bytes_freed")),
        StageSpec("optimizer_offload", "bench.gpu.optimizer_offload", {"cuda": 30, "cpu": 120},
                  doc="learner.optimizer_offload: the device memory it frees between steps, "
                      "the step's peak and seconds with and without it, the same weights",
                  headline=("state_gib", "freed_gib", "freed_vs_state", "step_peak_gib_kept",
                            "step_peak_gib_offloaded", "step_time_ratio", "max_weight_diff")),
        StageSpec("demo", "bench.gpu.demo", {"cuda": 95, "cpu": 400},
                  doc="5 steps of fleetrl train (configs/demo_cuda.yaml) through Ray",
                  headline=("steps", "step_s_median", "samples_per_s", "tokens_per_step", "wall_s",
                            "peak_gib", "plan_learner_gib")),
        StageSpec("accuracy", "bench.gpu.accuracy", {"cuda": 155, "cpu": 700}, min_s=60,
                  doc="η 0 vs η 4, one seed: time to the target score",
                  headline=("time_to_target_vs_sync", "final_gap_eta4",
                            "sync_generation_share", "overlap_speedup_bound",
                            "time_to_target_s_eta0", "time_to_target_s_eta4")),
        StageSpec("sglang", "bench.gpu.sglang_stages", {"cuda": 420, "cpu": 0}, min_s=120,
                  doc="a real SGLang server: logprobs vs the learner, throughput, "
                      "gloo/NCCL sync, the demo on SGLang engines"),
        StageSpec("vllm", "bench.gpu.vllm_stages", {"cuda": 300, "cpu": 600}, min_s=120,
                  doc="a real vllm serve: logprobs vs the learner through fleetrl's client, "
                      "throughput, a weight push over NCCL through vLLM's weight-transfer routes"),
    )
}  # fmt: skip


def sglang_skip_reason(device: str) -> str | None:
    """Why the SGLang stages cannot run here (None: they can)."""
    if device != "cuda":
        return "SGLang's CUDA engine needs a GPU (--device cuda)"
    for module in ("sglang", "sgl_kernel"):
        if importlib.util.find_spec(module) is None:
            return (
                f"{module} is not installed: the SGLang stages need a machine with SGLang's "
                "CUDA engine (the H200 machine the check targets cannot have it)"
            )
    return None


def vllm_skip_reason(device: str, options: dict[str, str]) -> str | None:
    """Why the vLLM stages cannot run here (None: they can). On a CPU they run only against
    the server ``--vllm-server`` names (bench.gpu.vllm_stages)."""
    if device != "cuda" and not options.get("vllm_server"):
        return "vLLM's CUDA engine needs a GPU (--device cuda; on a CPU, --vllm-server)"
    if importlib.util.find_spec("vllm") is None:
        return (
            "vllm is not installed: the vLLM stages need a machine with vLLM 0.34 "
            '(pip install ".[vllm]" in the fleetrl checkout; the H200 machine the check targets cannot have it)'
        )
    return None


# A stage that reports several results: name -> (their names, why it cannot run here or None)
MULTI_STAGES: dict[str, tuple[tuple[str, ...], Callable[[str, dict[str, str]], str | None]]] = {
    "sglang": (SGLANG_STAGE_NAMES, lambda device, options: sglang_skip_reason(device)),
    "vllm": (VLLM_STAGE_NAMES, vllm_skip_reason),
}


def headlines() -> dict[str, tuple[str, ...]]:
    """Each stage's headline figures, by stage name (the SGLang and vLLM ones under their own
    names)."""
    from bench.gpu.sglang_stages import HEADLINES as SGLANG_HEADLINES
    from bench.gpu.vllm_stages import HEADLINES as VLLM_HEADLINES

    return {**{name: spec.headline for name, spec in STAGES.items()}, **SGLANG_HEADLINES,
            **VLLM_HEADLINES}  # fmt: skip
