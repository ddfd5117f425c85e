"""Stage ``optimizer_offload``: the device memory ``learner.optimizer_offload`` frees, and
what its streamed update costs.

Two ``LearnerWorker`` runs, one rank each, on the same random-init Qwen2-shaped model (CUDA:
hidden 896, 8 layers, Qwen2.5's vocabulary 151,936, untied head: ~0.4 B parameters), two
steps each on the same synthetic GRPO batch: without
the offload, then with it (``learner.optimizer_offload_chunk_mb`` 256), in fp32 with
deterministic kernels where torch has them (the two runs' weights are compared; the fp32
master weights and the optimizer state are what bf16 runs hold too). Between steps (after
the second) the device memory allocated (``torch.cuda.memory_allocated``) is read in each
run: ``freed_gib`` is their difference and ``state_gib`` what the optimizer holds (on the
host with the offload); the step's peak (``torch.cuda.max_memory_allocated``) and seconds
are read for both, and the plan's optimizer column (``learner.memory.learner_estimate``)
for both configs; the trained weights of the two runs are compared (the streamed update is
AdamW's own: ``max_weight_diff`` should be 0).

It fails when the offload frees less than 90 % of the optimizer state, the state is not on
the host between steps, or the weights differ by more than ``WEIGHT_TOLERANCE`` (kernels
torch has no deterministic form of may leave rounding-level differences). On the CPU (tiny sizes,
fp32) the moves are no-ops: only the state's place and the weights are checked.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.gpu.stage import CheckFailed, StageContext

SIZES = {  # (hidden, layers, heads, kv heads, intermediate, vocab, sequences, tokens each)
    "cuda": (896, 8, 14, 2, 4864, 151936, 32, 256),
    "cpu": (64, 2, 4, 2, 128, 512, 4, 16),
}
CHUNK_MB = 256
STEPS = 2
WEIGHT_TOLERANCE = 1e-5


def _run(model_dir: Path, batch: Any, ctx: StageContext, offload: bool) -> dict[str, Any]:
    """Two steps with or without the offload: memory between steps, peak, seconds, weights."""
    import msgspec
    import torch

    from fleetrl.models.config import ModelConfig
    from learner.config import LearnerConfig
    from learner.worker import LearnerWorker
    from rollout_fleet.sglang_launcher import free_port

    cfg = msgspec.convert(
        {"optim": {"lr": 1e-4, "eps": 1e-6}, "correction": {"mode": "bypass"},
         "mixed_precision": "fp32", "optimizer_offload": offload,
         "optimizer_offload_chunk_mb": CHUNK_MB},
        LearnerConfig,
    )  # fmt: skip
    worker = LearnerWorker(
        cfg, ModelConfig(path=str(model_dir)), rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=free_port(), seed=0, device=ctx.device,
    )  # fmt: skip
    out: dict[str, Any] = {}
    try:
        worker.setup()
        for step in range(STEPS):
            if ctx.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            worker.step(batch, policy_version=step)
            if ctx.cuda:
                torch.cuda.synchronize()
            out["step_s"] = time.perf_counter() - started
        state = [v for s in worker.optimizer.state.values() for v in s.values() if v.dim() > 0]
        out["state_bytes"] = sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes for v in state)  # fmt: skip
        out["state_devices"] = sorted({str(v.device) for v in state})
        if ctx.cuda:
            out["allocated_between_steps"] = torch.cuda.memory_allocated()
            out["step_peak"] = torch.cuda.max_memory_allocated()
        out["weights"] = {n: t.float().cpu() for n, t in worker.named_full_tensors()}
    finally:
        worker.close()
        if ctx.cuda:
            torch.cuda.empty_cache()
    return out


def _plan_optimizer_gib(model_dir: Path, sizes: tuple, offload: bool, cuda: bool) -> float:
    import msgspec

    from learner.config import LearnerConfig
    from learner.memory import ModelShape, learner_estimate

    shape = ModelShape.from_config_dict(json.loads((model_dir / "config.json").read_text()))
    cfg = msgspec.convert({"optimizer_offload": offload, "optimizer_offload_chunk_mb": CHUNK_MB}, LearnerConfig)  # fmt: skip
    roles = learner_estimate(
        shape, cfg, on_gpu=cuda, max_seq_len=sizes[7], max_response_len=sizes[7] // 2,
        mini_batch_seqs=sizes[6], grad_checkpointing=False, with_reference=False,
        with_critic=False,
    )  # fmt: skip
    return sum(r.optimizer for r in roles) / 2**30


def run(ctx: StageContext) -> None:
    import os

    import torch

    from fleetrl.models.tiny import make_tiny_model
    from learner.synthetic import synthetic_batch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts here
    torch.use_deterministic_algorithms(True, warn_only=True)
    hidden, layers, heads, kv, inter, vocab, seqs, tokens = sizes = SIZES[ctx.device]
    model_dir = make_tiny_model(
        ctx.work / "model", arch="qwen2", layers=layers, hidden=hidden, heads=heads,
        kv_heads=kv, intermediate=inter, vocab_size=vocab, max_positions=2 * tokens, seed=0,
    )  # fmt: skip
    batch = synthetic_batch(
        vocab_size=vocab, groups=seqs // 4, group_size=4, prompt_lens=tokens // 2,
        response_lens=[tokens // 2] * seqs, seed=0,
    )  # fmt: skip
    kept = _run(model_dir, batch, ctx, offload=False)
    ctx.figures.update(state_gib=kept["state_bytes"] / 2**30, step_s_kept=kept["step_s"])
    ctx.save()
    streamed = _run(model_dir, batch, ctx, offload=True)
    diff = max(float((kept["weights"][n] - t).abs().max()) for n, t in streamed["weights"].items())  # fmt: skip
    ctx.figures.update(
        step_s_offloaded=streamed["step_s"], step_time_ratio=streamed["step_s"] / kept["step_s"],
        state_devices_offloaded=streamed["state_devices"], max_weight_diff=diff,
        plan_optimizer_gib_kept=_plan_optimizer_gib(model_dir, sizes, False, ctx.cuda),
        plan_optimizer_gib_offloaded=_plan_optimizer_gib(model_dir, sizes, True, ctx.cuda),
    )  # fmt: skip
    problems = []
    if streamed["state_devices"] != ["cpu"]:
        problems.append(f"optimizer state on {streamed['state_devices']} between steps")
    if diff > WEIGHT_TOLERANCE:
        problems.append(f"weights differ from the run without offload by {diff:.3g}")
    if ctx.cuda:
        freed = kept["allocated_between_steps"] - streamed["allocated_between_steps"]
        ctx.figures.update(
            freed_gib=freed / 2**30, freed_vs_state=freed / kept["state_bytes"],
            step_peak_gib_kept=kept["step_peak"] / 2**30,
            step_peak_gib_offloaded=streamed["step_peak"] / 2**30,
        )  # fmt: skip
        if freed < 0.9 * kept["state_bytes"]:
            problems.append(f"freed {freed / 2**30:.2f} GiB of {ctx.figures['state_gib']:.2f} GiB of state")  # fmt: skip
    if problems:
        raise CheckFailed("; ".join(problems))
