"""Stage ``learner``: fleetrl's learner step on a model of real width, packed vs padded.

One ``LearnerWorker`` (one rank, bf16 on CUDA) trains a random-init Qwen2-shaped model
(CUDA: Qwen2.5-0.5B's shape, 24 layers, hidden 896, 14/2 heads, vocabulary 151,936, tied
head: 494 M parameters) on one synthetic GRPO batch with long-tailed response lengths, in
``bench.learner.alternate_packing``'s alternation of packed and padded micro-batches until
the stage's deadline. Figures per arm: median tokens/s, achieved TFLOP/s and MFU, peak
device memory of one step (``perf/peak_memory_gb``) against ``fleetrl plan``'s estimate
for the same config (``learner.memory.learner_estimate``), and the paired packed ÷ padded
ratio.

Model FLOPs per step (``train_flops``; PaLM's accounting, no recomputation counted): per
token 6 × the matrix parameters (every block's linear layers and the LM head, also when
tied), plus causal attention 6 × layers × (heads × head_dim) × length per token of a
sequence (QKᵀ and AV, forward and backward, half the square under the mask), summed over
every token of every sequence (prompts too: the backward runs through them). The loss is
the bypass one (no proximal forward), as in ``bench.learner``. MFU is against the
datasheet's bf16 dense peak (``bench.gpu.machine``); the report pairs it with the product
measured on the device (``machine`` stage). On CPU the sizes are tiny and fp32: the figures
only prove the code runs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu.stage import CheckFailed, StageContext


@dataclasses.dataclass(frozen=True)
class LearnerSizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    groups: int
    group_size: int
    prompt_tokens: int
    response_median: int
    response_cap: int
    token_budget: int  # learner.max_tokens_per_micro_batch
    max_reps: int


SIZES = {
    # Qwen2.5-0.5B's shape; 128 sequences of 256 prompt tokens and lognormal responses
    # (median 256, capped at 1,024): about 80 k tokens a step
    "cuda": LearnerSizes(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                         vocab=151936, tied=True, groups=16, group_size=8, prompt_tokens=256,
                         response_median=256, response_cap=1024, token_budget=16384, max_reps=8),
    "cpu": LearnerSizes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512,
                        tied=True, groups=2, group_size=2, prompt_tokens=8, response_median=8,
                        response_cap=32, token_budget=256, max_reps=2),
}  # fmt: skip


def train_flops(shape: Any, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one forward and backward over sequences of ``seq_lens`` tokens."""
    matrix_params = shape.layers * sum(i * o for i, o in shape.block_linears().values())
    matrix_params += shape.vocab * shape.hidden  # the LM head's product, tied or not
    attention_width = shape.layers * shape.heads * shape.head_dim
    return float(sum(6 * matrix_params * n + 6 * attention_width * n * n for n in seq_lens))


def build_model(sizes: LearnerSizes, folder: Path) -> Path:
    from fleetrl.models.tiny import make_tiny_model

    return make_tiny_model(
        folder, arch="qwen2", layers=sizes.layers, hidden=sizes.hidden, heads=sizes.heads,
        kv_heads=sizes.kv_heads, intermediate=sizes.intermediate, vocab_size=sizes.vocab,
        tie_embeddings=sizes.tied, max_positions=sizes.prompt_tokens + sizes.response_cap + 64,
        seed=0,
    )  # fmt: skip


def _peak_of_one_step(worker: Any, batch: Any, packing: bool, cuda: bool) -> float:
    """``perf/peak_memory_gb`` of one step with ``packing`` (CUDA: counted from this step)."""
    import msgspec
    import torch

    worker.cfg = msgspec.structs.replace(worker.cfg, packing=packing)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    return float(worker.step(batch, policy_version=0)["perf/peak_memory_gb"])


def run(ctx: StageContext) -> None:
    import msgspec

    from bench.gpu.machine import datasheet_peak
    from bench.learner import alternate_packing, paired_ratios
    from fleetrl.models.config import ModelConfig
    from learner.config import LearnerConfig
    from learner.memory import ModelShape, learner_estimate
    from learner.synthetic import lognormal_lengths, synthetic_batch
    from learner.worker import LearnerWorker
    from rollout_fleet.sglang_launcher import free_port

    sizes = SIZES[ctx.device]
    t0 = time.monotonic()
    model_dir = build_model(sizes, ctx.work / "model")
    shape = ModelShape.from_config_dict(json.loads((model_dir / "config.json").read_text()))
    ctx.figures.update(sizes=dataclasses.asdict(sizes), parameters=shape.params(),
                       model_build_s=round(time.monotonic() - t0, 1))  # fmt: skip
    ctx.save()
    cfg = msgspec.convert(
        {
            "optim": {"lr": 1e-6},
            "correction": {"mode": "bypass"},
            "max_tokens_per_micro_batch": sizes.token_budget,
            "mixed_precision": "bf16" if ctx.cuda else "fp32",
        },
        LearnerConfig,
    )
    n = sizes.groups * sizes.group_size
    lens = lognormal_lengths(n, median=sizes.response_median, sigma=1.0, low=1,
                             high=sizes.response_cap, seed=0)  # fmt: skip
    batch = synthetic_batch(vocab_size=sizes.vocab, groups=sizes.groups,
                            group_size=sizes.group_size, prompt_lens=sizes.prompt_tokens,
                            response_lens=lens.tolist(), seed=0)  # fmt: skip
    seq_lens = [sizes.prompt_tokens + int(x) for x in lens]
    flops = train_flops(shape, seq_lens)
    tokens = sum(seq_lens)
    ctx.figures.update(tokens_per_step=tokens, model_tflop_per_step=flops / 1e12)
    worker = LearnerWorker(
        cfg, ModelConfig(path=str(model_dir)), rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=free_port(), seed=0, device=ctx.device,
    )  # fmt: skip
    try:
        worker.setup()
        # two memory steps (one per arm) after the timed part: keep time for them
        step_s_guess = max(2.0, 0.1 * ctx.seconds_left())
        samples = alternate_packing(
            worker, batch, sizes.max_reps, deadline=ctx.deadline - 2 * step_s_guess
        )
        peaks = {arm: _peak_of_one_step(worker, batch, arm == "packed", ctx.cuda)
                 for arm in ("packed", "padded")}  # fmt: skip
    finally:
        worker.close()
    peak_flops, peak_source = None, ""
    if ctx.cuda:
        import torch

        peak_flops, peak_source = datasheet_peak(torch.cuda.get_device_name(0))
    plan = learner_estimate(
        shape, cfg, on_gpu=ctx.cuda, max_seq_len=sizes.prompt_tokens + sizes.response_cap,
        max_response_len=sizes.response_cap, mini_batch_seqs=n, grad_checkpointing=False,
        with_reference=False, with_critic=False,
    )  # fmt: skip
    plan_gib = sum(role.total for role in plan) / 2**30
    ctx.figures.update(reps=len(samples["packed"]), plan_learner_gib=plan_gib,
                       datasheet_source=peak_source or None)  # fmt: skip
    for arm, rates in samples.items():
        rate = statistics.median(rates)
        achieved = rate * flops / tokens
        ctx.figures[f"tokens_per_s_{arm}"] = rate
        ctx.figures[f"tflops_{arm}"] = achieved / 1e12
        ctx.figures[f"mfu_{arm}"] = achieved / peak_flops if peak_flops else None
        ctx.figures[f"peak_gib_{arm}"] = peaks[arm]
        ctx.figures[f"peak_vs_plan_{arm}"] = peaks[arm] / plan_gib if plan_gib else None
    paired = paired_ratios(samples)
    ctx.figures.update(packed_vs_padded=statistics.median(paired), paired_ratios=paired)
    if not all(r > 0 for rates in samples.values() for r in rates):
        raise CheckFailed(f"a step reported no tokens/s: {samples}")
