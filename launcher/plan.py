"""`fleetrl plan`: will this model, cluster and config fit? Memory per device, per role, before launch.

    fleetrl plan --config configs/gsm8k_grpo_qwen2.5_7b.yaml [overrides] [--gpu-mem-gb 80]
        [--model-config configs/models/Qwen2.5-7B-Instruct.config.json]

Reads the model's ``config.json`` (or the tiny-model settings; ``--model-config``
names a config.json elsewhere, for planning before the weights are on disk) for its shape; no
weight is loaded and nothing is started. Learner devices hold one FSDP rank of
the policy, the reference and the critic (``learner.memory``); engine devices
hold one tensor-parallel slice of an engine: its weights in ``model.dtype`` and
the KV cache its ``max_running_requests`` full-length requests need, against
SGLang's static pool (``mem_fraction_static`` × device memory − weights); a placed
reward server holds the classifier's weights and one forward of ``reward.model.batch_size``
inputs (``reward_plan``). The
verdict compares each device's total with the device memory; the what-if table
says which single change (offload, more ranks, gradient checkpointing, sequence
parallelism, a smaller token budget) moves it. The learner logs
``plan/learner_gb`` (this estimate for its device) next to its measured
``perf/peak_memory_gb`` so a run shows how close the plan came.

Co-located runs (``rollout.placement: colocated``): one device holds a learner rank
and an engine in turns, and must hold the larger of the two phases
(``launcher.plan_colocated``); on CPU the host's memory is shared by the ranks.

With ``learner.lora.rank`` > 0 only the adapters get gradients and optimizer
state and no reference copy is counted; the what-if table shows LoRA rank 64
for a full-training config.

Left out: SGLang's CUDA-graph and
activation memory beyond its static pool, pipeline/tensor parallel learners.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from launcher.config import RunConfig, load_run_config
from learner.config import LearnerConfig
from learner.memory import GB, ModelShape, RoleMemory, learner_estimate

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a GPU learner process holds beyond the estimate: CUDA context, NCCL buffers,
# allocator fragmentation. Kept out of plan/learner_gb (max_memory_allocated excludes it too).
GPU_RUNTIME_RESERVE_GB = 2.0


@dataclass
class EnginePlan:
    tp: int
    weights_gb: float
    kv_needed_gb: float
    static_gb: float  # SGLang's pool: weights + KV (0 for the embedded engine: it has none)

    @property
    def kv_pool_gb(self) -> float:
        return self.static_gb - self.weights_gb

    def total_gb(self, on_gpu: bool) -> float:
        return self.static_gb if on_gpu else self.weights_gb + self.kv_needed_gb


@dataclass
class RewardServerPlan:
    """One reward server's device: the classifier's weights and one forward's transients."""

    backend: str
    tp: int
    weights_gb: float
    forward_gb: float  # activations of the largest forward (one layer at a time)
    static_gb: float  # SGLang's pool (mem_fraction_static × device); 0 for the embedded engine

    def total_gb(self) -> float:
        return self.static_gb if self.backend == "sglang" else self.weights_gb + self.forward_gb


def reward_plan(cfg: RunConfig, gpu_mem_gb: float) -> RewardServerPlan | None:
    """The plan of one placed reward server (None when the run places none).

    Weights: the classifier's parameters (no LM head; a one-value score head) in
    ``model.dtype`` over its tensor-parallel ranks. One forward reads ``batch_size`` inputs
    of ``reward.model.max_length`` tokens (else prompt + response); the embedded engine cuts
    it at ``MAX_BATCH_TOKENS`` padded tokens and, without a fused attention kernel on the
    CPU, holds one layer's hidden and MLP states and its attention scores at a time.
    """
    from rollout_fleet.engine.score_runner import MAX_BATCH_TOKENS
    from rollout_fleet.rewards.fleet import reward_backend

    if not cfg.reward.places_fleet:
        return None
    model = cfg.reward.model
    shape = ModelShape.from_config_dict(json.loads((Path(model.path) / "config.json").read_text()))
    db = DTYPE_BYTES[cfg.model.dtype]
    backend = reward_backend(model, cfg.rollout)
    tp = max(1, int(model.gpus_per_engine)) if backend == "sglang" else 1
    length = model.max_length or cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if backend == "sglang":
        tokens, scores = model.batch_size * length, 0.0  # flash attention: no T × T scores
        static = model.mem_fraction_static * gpu_mem_gb * GB
    else:
        rows = max(1, min(model.batch_size, MAX_BATCH_TOKENS // length))
        tokens, scores = rows * length, rows * shape.heads * length**2 * 4.0
        static = 0.0
    forward = tokens * (shape.hidden + shape.intermediate) * db / tp + scores / tp
    return RewardServerPlan(
        backend=backend,
        tp=tp,
        weights_gb=shape.params(lm_head=False) * db / tp / GB,
        forward_gb=forward / GB,
        static_gb=static / GB,
    )


def _reward_lines(cfg: RunConfig, plan: RewardServerPlan) -> tuple[str, str, bool]:
    """The reward server's table row, its verdict line, and whether it fits."""
    row = (
        f"| reward server (TP {plan.tp}) | weights + one forward | {plan.weights_gb:.3f} | | | | "
        f"forward {plan.forward_gb:.3f} | | **{plan.total_gb():.3f}** | |"
    )
    if plan.backend != "sglang":
        line = (
            f"reward servers on CPU: {plan.total_gb():.3f} GiB of host memory each "
            f"({cfg.reward.model.num_engines} placed on 'reward' nodes)"
        )
        return row, line, True
    ok = plan.weights_gb + plan.forward_gb < plan.static_gb
    line = (
        f"reward server device: SGLang reserves mem_fraction_static {cfg.reward.model.mem_fraction_static} "
        f"× device = {plan.static_gb:.2f} GiB; weights {plan.weights_gb:.2f} + one forward "
        f"{plan.forward_gb:.2f}: {'fits' if ok else 'DOES NOT FIT'}"
    )
    return row, line, ok


def learner_on_gpu(cfg: RunConfig) -> bool:
    return cfg.trainer.device == "cuda" or (
        cfg.trainer.device == "auto" and cfg.learner.gpus_per_rank > 0
    )


def model_shape(cfg: RunConfig, model_config: str | None = None) -> ModelShape:
    """The model's sizes: from ``model_config`` (a config.json) when given, else model.path's."""
    if model_config:
        path = Path(model_config)
        if not path.is_file():
            raise FileNotFoundError(f"--model-config {path.absolute()} not found")
        return ModelShape.from_config_dict(json.loads(path.read_text()))
    try:
        return ModelShape.from_model_config(cfg.model)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{err}; to plan before the weights are on disk, give the model's config.json: "
            "--model-config FILE (configs/models/ holds some)"
        ) from None


def learner_roles(
    cfg: RunConfig, shape: ModelShape, learner: LearnerConfig | None = None
) -> list[RoleMemory]:
    """The learner estimate of ``cfg`` (or of ``cfg`` with another learner section)."""
    lc = learner or cfg.learner
    critic_mode = lc.critic.enabled
    return learner_estimate(
        shape,
        lc,
        on_gpu=learner_on_gpu(cfg),
        max_seq_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        max_response_len=cfg.rollout.max_new_tokens,
        mini_batch_seqs=(lc.ppo_mini_batch_size or cfg.data.train_batch_size) * cfg.rollout.n,
        grad_checkpointing=lc.grad_checkpointing or cfg.model.gradient_checkpointing,
        with_reference=lc.kl.use_kl_in_reward or lc.kl.use_kl_loss,
        with_critic=critic_mode == "on"
        or (critic_mode == "auto" and lc.algorithm.adv_estimator == "gae"),
    )


def learner_gb(cfg: RunConfig) -> float:
    """The planned bytes of one learner device, in GiB (what ``plan/learner_gb`` logs)."""
    return sum(r.total for r in learner_roles(cfg, model_shape(cfg))) / GB


def engine_plan(cfg: RunConfig, shape: ModelShape, gpu_mem_gb: float) -> EnginePlan:
    db = DTYPE_BYTES[cfg.model.dtype]
    tp = cfg.rollout.tp_size
    context = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    kv = cfg.rollout.max_running_requests * context * shape.kv_bytes_per_token(db) / tp
    on_gpu = cfg.rollout.backend == "sglang"
    static = cfg.rollout.mem_fraction_static * gpu_mem_gb * GB if on_gpu else 0.0
    return EnginePlan(tp=tp, weights_gb=shape.params() * db / tp / GB, kv_needed_gb=kv / GB,
                      static_gb=static / GB)  # fmt: skip


def _with(cfg: RunConfig, **learner_changes) -> LearnerConfig:
    return msgspec.structs.replace(cfg.learner, **learner_changes)


def what_ifs(cfg: RunConfig, shape: ModelShape) -> list[tuple[str, float]]:
    """(change, learner GiB per device) for single changes that move the learner's memory."""
    lc = cfg.learner
    options: list[tuple[str, LearnerConfig, None]] = []
    if learner_on_gpu(cfg) and not lc.param_offload:
        options.append(("learner.param_offload=true", _with(cfg, param_offload=True), None))
    options.append((f"learner.num_ranks={2 * lc.num_ranks}", _with(cfg, num_ranks=2 * lc.num_ranks), None))  # fmt: skip
    if not (lc.grad_checkpointing or cfg.model.gradient_checkpointing):
        options.append(("learner.grad_checkpointing=true", _with(cfg, grad_checkpointing=True), None))  # fmt: skip
    half = max(1, lc.max_tokens_per_micro_batch // 2)
    options.append((f"learner.max_tokens_per_micro_batch={half}", _with(cfg, max_tokens_per_micro_batch=half), None))  # fmt: skip
    for k in (2, 4):
        sp = lc.sequence_parallel * k
        if lc.num_ranks % sp == 0:
            budget = max(1, lc.max_tokens_per_micro_batch // k)
            options.append((
                f"learner.sequence_parallel={sp} + max_tokens_per_micro_batch={budget} "
                "(same micro-batch, split over the SP group)",
                _with(cfg, sequence_parallel=sp, max_tokens_per_micro_batch=budget), None,
            ))  # fmt: skip
    out = []
    if lc.lora.rank == 0:
        lora = msgspec.structs.replace(lc.lora, rank=64)
        options.append(("learner.lora.rank=64 (all-linear; adapters train, no reference copy)", _with(cfg, lora=lora), None))  # fmt: skip
    for label, learner, _ in options:
        out.append((label, sum(r.total for r in learner_roles(cfg, shape, learner)) / GB))
    return out


def render(cfg: RunConfig, gpu_mem_gb: float, model_config: str | None = None) -> tuple[str, bool]:
    """The plan as Markdown, and whether every device fits."""
    shape = model_shape(cfg, model_config)
    on_gpu = learner_on_gpu(cfg)
    roles = learner_roles(cfg, shape)
    g = lambda b: f"{b / GB:.3f}"  # noqa: E731
    lines = [
        f"model {cfg.model.path}: {_count(shape.params())} parameters ({shape.layers} layers, "
        f"hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, vocab {shape.vocab})",
        f"learner: {cfg.learner.num_ranks} ranks on {'GPU' if on_gpu else 'CPU'}, "
        f"sequence_parallel {cfg.learner.sequence_parallel}, token budget "
        f"{cfg.learner.max_tokens_per_micro_batch}/rank, max sequence "
        f"{cfg.data.max_prompt_length + cfg.rollout.max_new_tokens}",
        "",
        "| device | role | weights | grads | optimizer | gathered | activations | logits | total GiB | on host (offload) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in roles:
        lines.append(
            f"| learner | {r.role} | {g(r.weights)} | {g(r.grads)} | {g(r.optimizer)} | "
            f"{g(r.gathered)} | {g(r.activations)} | {g(r.logits)} | {g(r.total)} | {g(r.host)} |"
        )
    total_learner = sum(r.total for r in roles) / GB
    lines.append(f"| learner | **all roles** | | | | | | | **{total_learner:.3f}** | "
                 f"{sum(r.host for r in roles) / GB:.3f} |")  # fmt: skip
    eng = engine_plan(cfg, shape, gpu_mem_gb)
    engine_gpu = cfg.rollout.backend == "sglang"
    lines.append(
        f"| engine (TP {eng.tp}) | weights + KV | {eng.weights_gb:.3f} | | | | "
        f"KV needed {eng.kv_needed_gb:.3f} | | **{eng.total_gb(engine_gpu):.3f}** | |"
    )
    reward = reward_plan(cfg, gpu_mem_gb)
    if reward is not None:
        reward_row, reward_line, reward_fits = _reward_lines(cfg, reward)
        lines.append(reward_row)
    lines.append("")
    fits = True
    if cfg.rollout.colocated:  # one device holds a rank and an engine, in turns
        from launcher.plan_colocated import colocated_phases, render_phases

        device_gb = gpu_mem_gb if on_gpu else host_memory_gb() / cfg.learner.num_ranks
        phases = colocated_phases(cfg, shape, device_gb, on_gpu=on_gpu)
        lines += render_phases(phases, on_gpu)
        fits = phases.fits
    elif on_gpu:
        budget = gpu_mem_gb - GPU_RUNTIME_RESERVE_GB
        ok = total_learner <= budget
        fits &= ok
        lines.append(
            f"learner device: {total_learner:.3f} GiB planned + {GPU_RUNTIME_RESERVE_GB:.0f} GiB "
            f"runtime reserve vs {gpu_mem_gb:.0f} GiB: {'fits' if ok else 'DOES NOT FIT'}"
        )
    else:
        lines.append(f"learner on CPU: {total_learner:.3f} GiB of host memory per rank")
    if engine_gpu and cfg.rollout.num_engines > cfg.rollout.colocated_engines:
        ok = eng.weights_gb < eng.static_gb
        fits &= ok
        kv_note = (
            "the KV pool holds every running request at full length"
            if eng.kv_needed_gb <= eng.kv_pool_gb
            else f"KV-bound: SGLang will run about "
            f"{int(cfg.rollout.max_running_requests * max(eng.kv_pool_gb, 0) / eng.kv_needed_gb)}"
            " full-length requests at once, not max_running_requests"
        )
        lines.append(
            f"engine device: SGLang reserves mem_fraction_static {cfg.rollout.mem_fraction_static} "
            f"× {gpu_mem_gb:.0f} = {eng.static_gb:.2f} GiB; weights {eng.weights_gb:.2f}, "
            f"KV pool {eng.kv_pool_gb:.2f} vs {eng.kv_needed_gb:.2f} needed: "
            f"{'fits' if ok else 'DOES NOT FIT (weights exceed the static pool)'}; {kv_note}"
        )
    if reward is not None:
        lines.append(reward_line)
        fits &= reward_fits
    lines += ["", "| change (one at a time) | learner GiB per device |", "|---|---|"]
    lines.append(f"| as configured | {total_learner:.3f} |")
    lines += [f"| {label} | {gb:.3f} |" for label, gb in what_ifs(cfg, shape)]
    return "\n".join(lines) + "\n", fits


def host_memory_gb() -> float:
    """This machine's memory (a co-located CPU run's ranks and engines share it)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def main(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, args.overrides)
    text, fits = render(cfg, args.gpu_mem_gb, args.model_config)
    sys.stdout.write(text)
    return 0 if fits else 1
