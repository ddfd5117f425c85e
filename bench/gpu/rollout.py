"""Stage ``rollout``: the embedded engine against transformers ``generate`` on the same GRPO groups.

``bench.rollout.run`` on the device (bf16 on CUDA): 8 prompts × 8 samples of 128 prompt
and 128 new tokens (EOS ignored, so both sides decode the same number of tokens) with a
random-init Qwen2-shaped model of Qwen2.5-0.5B's width and half its depth (12 layers,
hidden 896, 14 heads); the engine over its HTTP API with the client in this process and
in another, its scheduler without HTTP (prefill shared across a group's samples, and not),
and one ``model.generate(num_return_sequences=8)`` call, alternated until the deadline.
Figures: output tokens/s of each side and the suite's ratios (``vs_hf_generate``: the
engine over HTTP ÷ ``generate``). What it leaves out: SGLang (its stages need its CUDA
engine) and CUDA graphs (the embedded engine has none).
"""

from __future__ import annotations

from bench.gpu.stage import CheckFailed, StageContext

SIZES = {
    "cuda": {"batch": 8, "group_size": 8, "prompt_tokens": 128, "max_new_tokens": 128,
             "hidden": 896, "layers": 12, "heads": 14, "reps": 5, "dtype": "bfloat16"},
    "cpu": {"batch": 2, "group_size": 2, "prompt_tokens": 8, "max_new_tokens": 8,
            "hidden": 64, "layers": 2, "heads": 4, "reps": 1, "dtype": "float32"},
}  # fmt: skip
SUMMARY_KEYS = (
    "vs_hf_generate",
    "engine_tokens_per_s",
    "hf_generate_tokens_per_s",
    "remote_client_tokens_per_s",
    "scheduler_tokens_per_s",
    "prefill_sharing_speedup",
    "paired_vs_hf_generate",
)


def run(ctx: StageContext) -> None:
    from bench.rollout import run as rollout_run

    sizes = SIZES[ctx.device]
    ctx.figures["sizes"] = sizes
    record = rollout_run(ctx.work, device=ctx.device, deadline=ctx.deadline, **sizes)
    summary = record["summary"]
    ctx.figures.update({key: summary.get(key) for key in SUMMARY_KEYS})
    ctx.figures["reps_done"] = len(record["results"]["engine_tokens_per_s"]["reps"])
    if not (summary.get("engine_tokens_per_s") or 0) > 0:
        raise CheckFailed(f"the engine reported no throughput: {summary}")
