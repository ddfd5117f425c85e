"""From a resolved verl config to fleetrl settings: the table's direct maps, then the rules
that read several verl keys at once.

``translate(values, fleetrl_overrides)`` takes every verl leaf (dotted key -> value, verl's
defaults filled in and interpolations resolved) and returns a ``Translation``: one
``Setting`` per fleetrl key, each naming the verl key(s) it comes from and why (what
``fleetrl config from-verl`` writes as comments, and what a config error is reported
against), plus the lines that say how the run differs (the GPU split).
``fleetrl_overrides`` are the fleetrl keys the user set beside the verl file: the GPU split
fits around the learner ranks or engines given there.

The rules, each verl's meaning (ray_trainer.py, workers/config/*.py):
- GPUs (decided before any rule that divides a size per GPU, ``micro_batches``):
  ``trainer.n_gpus_per_node`` x ``nnodes`` (less a reward server's, unless the
  reward model has its own pool) are split between learner ranks (one GPU each) and
  SGLang engines (``tensor_model_parallel_size`` GPUs each): half to each side, engines
  rounded down to whole engines; one GPU is shared (half each, gloo weight sync).
- Micro-batches: ``ppo_micro_batch_size_per_gpu``, else the deprecated global
  ``ppo_micro_batch_size`` divided by the data-parallel learner ranks of that split.
- Steps: ``trainer.total_training_steps``, else ``total_epochs`` (counted at start).
- Warm-up: ``lr_warmup_steps`` > 0, else ``lr_warmup_steps_ratio``; schedule:
  ``warmup_style`` (deprecated) over ``lr_scheduler_type``; clipping: the workers'
  ``grad_clip`` over ``optim.clip_grad``; PPO bounds: ``clip_ratio_low/high``, null =
  ``clip_ratio``.
- Reward model (``reward_model.enable``): verl scores with the model alone, raw: the
  rule weight is 0 and the score is neither normalised nor clipped.
- Synchronous: verl's trainer generates and trains in turn on one policy, so
  ``buffer.max_staleness`` is 0 (set it in the ``fleetrl:`` section to go asynchronous).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetrl.config import ConfigError
from launcher.verl.keys_model import expand
from launcher.verl.table import KeyTable
from rollout_fleet.engine_kinds import engine_kind


@dataclass(frozen=True)
class Setting:
    key: str  # fleetrl dotted key
    value: Any
    source: str  # the verl key(s) it comes from
    why: str = ""


class VerlRefused(ConfigError):
    """verl values fleetrl cannot honour: one line each (the CLI prints them, exit 2)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)
        self.path = self.lines[0].split(":", 1)[0].removeprefix("verl key ")
        ValueError.__init__(self, "; ".join(self.lines))


def refusal(key: str, got: Any, fix: str) -> str:
    return f"verl key {key}: got {got!r}; set {fix}"


@dataclass
class Translation:
    settings: dict[str, Setting] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # how this run is laid out (logged)
    split_decided: bool = False  # the GPU split (``gpus``) has run: learner ranks are final

    def learner_ranks(self, fleetrl_overrides: dict[str, Any]) -> int:
        """The run's learner ranks: the user's, else the GPU split's. Rules that divide a
        verl size per GPU read it, and run after the split (``RULES`` order)."""
        if not self.split_decided:
            raise RuntimeError("a per-GPU rule ran before the GPU split: reorder RULES")
        ranks = _get(fleetrl_overrides, "learner.num_ranks")
        if ranks is None and "learner.num_ranks" in self.settings:
            ranks = self.settings["learner.num_ranks"].value
        return int(ranks or 1)

    def set(self, key: str, value: Any, source: str, why: str = "") -> None:
        self.settings[key] = Setting(key, value, source, why)

    def as_dict(self) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for setting in self.settings.values():
            node = tree
            *parents, leaf = setting.key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = setting.value
        return tree

    def source_of(self, fleetrl_key: str) -> Setting | None:
        """The setting a fleetrl key (or a key below it) came from."""
        parts = fleetrl_key.split(".")
        for end in range(len(parts), 0, -1):
            hit = self.settings.get(".".join(parts[:end]))
            if hit is not None:
                return hit
        return None


Values = dict[str, Any]
RULES: list[Callable[[Values, Translation, dict[str, Any]], None]] = []


def rule(fn: Callable[[Values, Translation, dict[str, Any]], None]):
    RULES.append(fn)
    return fn


def translate(table: KeyTable, values: Values, fleetrl_overrides: dict[str, Any]) -> Translation:
    out = Translation()
    for key in table.keys:
        if key.kind == "map" and key.path in values:
            value = values[key.path]
            out.set(key.to, key.convert(value) if key.convert else value, key.path, key.why)
    refused: list[str] = []
    for fn in RULES:
        try:
            fn(values, out, fleetrl_overrides)
        except VerlRefused as err:
            refused += err.lines
    if refused:
        raise VerlRefused(refused)
    return out


def _get(overrides: dict[str, Any], dotted: str) -> Any:
    node: Any = overrides
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# ---- the rules ------------------------------------------------------------------------------

A, RO = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


@rule
def rollout_backend(v: Values, out: Translation, _: dict) -> None:
    kind = engine_kind(v[f"{RO}.name"])  # verl's names are fleetrl's backends
    out.set("rollout.backend", kind.backend, f"{RO}.name", f"{kind.label} servers")
    memory = f"rollout.{kind.memory_field}"  # the engine's own fraction, of its own GPUs here
    out.set(memory, v[f"{RO}.gpu_memory_utilization"], f"{RO}.gpu_memory_utilization")


@rule
def synchronous(v: Values, out: Translation, _: dict) -> None:
    out.set(
        "buffer.max_staleness", 0, "(verl's trainer)",
        "verl's trainer generates and trains in turn on one policy: on-policy, staleness 0 "
        "(fleetrl.buffer.max_staleness > 0 trains asynchronously)",
    )  # fmt: skip


def _optim(v: Values, out: Translation, prefix: str, clip_key: str, to: str) -> None:
    o = f"{prefix}.optim"
    steps = v.get(f"{o}.lr_warmup_steps")
    if steps is not None and steps > 0:
        out.set(f"{to}.warmup_steps", steps, f"{o}.lr_warmup_steps")
    elif v.get(f"{o}.lr_warmup_steps_ratio"):
        out.set(f"{to}.warmup_ratio", v[f"{o}.lr_warmup_steps_ratio"], f"{o}.lr_warmup_steps_ratio", "lr_warmup_steps is -1: the ratio decides")  # fmt: skip
    style = v.get(f"{o}.warmup_style")
    source = f"{o}.warmup_style" if style is not None else f"{o}.lr_scheduler_type"
    out.set(f"{to}.schedule", style or v[f"{o}.lr_scheduler_type"], source)
    legacy = v.get(clip_key)
    if legacy is not None and legacy != 1.0:
        out.set(f"{to}.grad_clip", legacy, clip_key, "verl's FSDP workers clip with it")
    else:
        out.set(f"{to}.grad_clip", v[f"{o}.clip_grad"], f"{o}.clip_grad")


@rule
def optimizers(v: Values, out: Translation, _: dict) -> None:
    _optim(v, out, A, f"{A}.grad_clip", "learner.optim")
    _optim(v, out, "critic", "critic.grad_clip", "learner.critic.optim")


@rule
def ppo_clip(v: Values, out: Translation, _: dict) -> None:
    for side in ("low", "high"):
        bound = v.get(f"{A}.clip_ratio_{side}")
        source = f"{A}.clip_ratio_{side}" if bound is not None else f"{A}.clip_ratio"
        value = bound if bound is not None else v[f"{A}.clip_ratio"]
        out.set(f"learner.policy_loss.clip_ratio_{side}", value, source)


@rule
def mixed_precision(v: Values, out: Translation, _: dict) -> None:
    dtype = v[f"{A}.fsdp_config.dtype"]
    value = "auto" if dtype in ("bfloat16", "bf16") else "fp32"
    out.set("learner.mixed_precision", value, f"{A}.fsdp_config.dtype", "bf16 compute on GPU")


@rule
def sglang_arguments(v: Values, out: Translation, _: dict) -> None:
    args = list(out.settings["rollout.sglang_extra_args"].value)
    sources = [f"{RO}.engine_kwargs.sglang"]
    if v[f"{RO}.expert_parallel_size"] != 1:
        args += ["--ep-size", str(v[f"{RO}.expert_parallel_size"])]
        sources.append(f"{RO}.expert_parallel_size")
    if v[f"{RO}.max_model_len"]:
        args += ["--context-length", str(v[f"{RO}.max_model_len"])]
        sources.append(f"{RO}.max_model_len")
    if not v[f"{RO}.enable_prefix_caching"]:
        args.append("--disable-radix-cache")
        sources.append(f"{RO}.enable_prefix_caching")
    out.set("rollout.sglang_extra_args", args, ", ".join(sources), "SGLang server arguments")


@rule
def validation_sampling(v: Values, out: Translation, _: dict) -> None:
    greedy = not v[f"{RO}.val_kwargs.do_sample"]
    temperature = 0.0 if greedy else float(v[f"{RO}.val_kwargs.temperature"])
    out.set("rollout.val_temperature", temperature, f"{RO}.val_kwargs.do_sample, temperature", "do_sample false: greedy")  # fmt: skip


@rule
def critic(v: Values, out: Translation, _: dict) -> None:
    enable = v["critic.enable"]
    state = "auto" if enable is None else "on" if enable else "off"
    out.set("learner.critic.enabled", state, "critic.enable", "null: a critic exactly with gae")
    path = expand(v["critic.model.path"])
    same = path == expand(v["actor_rollout_ref.model.path"])
    uses = state == "on" or (state == "auto" and v["algorithm.adv_estimator"] == "gae")
    out.set("learner.critic.model_path", "" if same or not uses else path, "critic.model.path", "empty: the policy's folder")  # fmt: skip
    refused = [
        refusal(
            f"critic.{key}",
            v[f"critic.{key}"],
            f"it to the actor's {v[f'{A}.{key}']!r} (the critic trains on the policy's {what})",
        )  # fmt: skip
        for key, what in (
            ("ppo_mini_batch_size", "mini-batches"),
            ("ppo_epochs", "epochs"),
            ("use_dynamic_bsz", "micro-batches"),
        )  # fmt: skip
        if uses and v[f"critic.{key}"] != v[f"{A}.{key}"]
    ]
    if refused:
        raise VerlRefused(refused)
    warmup = v["trainer.critic_warmup"]
    out.set("learner.critic.warmup_steps", max(0, warmup - 1), "trainer.critic_warmup", "verl trains the actor from global step critic_warmup on, counting from 1")  # fmt: skip


@rule
def data_truncation(v: Values, out: Translation, _: dict) -> None:
    if v["data.filter_overlong_prompts"]:
        out.set("data.truncation", "filter", "data.filter_overlong_prompts")
    else:
        out.set("data.truncation", v["data.truncation"], "data.truncation", "verl's default, error, refuses a run with an over-long prompt")  # fmt: skip


@rule
def steps(v: Values, out: Translation, _: dict) -> None:
    total = v["trainer.total_training_steps"]
    if total is not None:
        out.set("trainer.total_steps", total, "trainer.total_training_steps")
        out.set("trainer.total_epochs", 0, "trainer.total_training_steps", "the step count wins")
    else:
        out.set("trainer.total_epochs", v["trainer.total_epochs"], "trainer.total_epochs", "steps = epochs x (prompts // data.train_batch_size), counted at start")  # fmt: skip


@rule
def loggers(v: Values, out: Translation, _: dict) -> None:
    chosen = v["trainer.logger"]
    chosen = [chosen] if isinstance(chosen, str) else list(chosen)
    for name in ("wandb", "mlflow", "tensorboard"):
        out.set(f"logging.{name}", name in chosen, "trainer.logger")


@rule
def resume(v: Values, out: Translation, _: dict) -> None:
    mode, path = v["trainer.resume_mode"], v["trainer.resume_from_path"]
    if mode == "resume_path":
        if not path:
            raise VerlRefused([refusal("trainer.resume_from_path", path, "the checkpoint folder to resume (resume_mode is resume_path)")])  # fmt: skip
        out.set("trainer.resume_from_path", expand(path), "trainer.resume_mode, resume_from_path")
    out.set("trainer.resume", "disable" if mode == "disable" else "auto", "trainer.resume_mode")
    if path and mode != "resume_path":
        out.lines.append(f"trainer.resume_from_path={path!r} is not read: resume_mode is {mode!r} (verl reads it with resume_path only)")  # fmt: skip


@rule
def checkpoints_kept(v: Values, out: Translation, _: dict) -> None:
    kept = [n for n in (v["trainer.max_actor_ckpt_to_keep"], v["trainer.max_critic_ckpt_to_keep"]) if n]  # fmt: skip
    out.set("trainer.keep_checkpoints", max(kept, default=0), "trainer.max_actor_ckpt_to_keep, max_critic_ckpt_to_keep")  # fmt: skip


@rule
def corrections(v: Values, out: Translation, _: dict) -> None:
    rc = "algorithm.rollout_correction"
    is_mode, rs_mode, bypass = v[f"{rc}.rollout_is"], v[f"{rc}.rollout_rs"], v[f"{rc}.bypass_mode"]
    if sum(bool(x) for x in (is_mode, rs_mode, bypass)) > 1:
        raise VerlRefused([refusal(f"{rc}.rollout_is", is_mode, "one of rollout_is, rollout_rs, bypass_mode (fleetrl applies one correction)")])  # fmt: skip
    if bypass:
        out.set("learner.correction.mode", "bypass", f"{rc}.bypass_mode")
    elif is_mode:
        out.set("learner.correction.mode", "token_tis" if is_mode == "token" else "seq_tis", f"{rc}.rollout_is")  # fmt: skip
        out.set("learner.correction.is_cap", float(v[f"{rc}.rollout_is_threshold"]), f"{rc}.rollout_is_threshold")  # fmt: skip
    elif rs_mode:
        low, high = _bounds(v[f"{rc}.rollout_rs_threshold"])
        out.set("learner.correction.mode", "token_mis", f"{rc}.rollout_rs")
        out.set("learner.correction.is_low", low, f"{rc}.rollout_rs_threshold")
        out.set("learner.correction.is_high", high, f"{rc}.rollout_rs_threshold")


def _bounds(threshold: Any) -> tuple[float, float]:
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    try:
        if isinstance(threshold, str) and "_" in threshold:
            low, high = (float(x) for x in threshold.split("_", 1))
            return low, high
        high = float(threshold)
    except (TypeError, ValueError):
        raise VerlRefused([refusal(key, threshold, "lower_upper (e.g. 0.5_2.0) or one upper bound")]) from None  # fmt: skip
    return 1.0 / high, high


@rule
def dapo(v: Values, out: Translation, _: dict) -> None:
    if v.get("reward_model.overlong_buffer.enable"):
        out.set("learner.algorithm.overlong_buffer_len", v.get("reward_model.overlong_buffer.len", 0), "reward_model.overlong_buffer.len")  # fmt: skip
        out.set("learner.algorithm.overlong_penalty_factor", v.get("reward_model.overlong_buffer.penalty_factor", 1.0), "reward_model.overlong_buffer.penalty_factor")  # fmt: skip
    if v.get("algorithm.filter_groups.enable"):
        out.set("buffer.filter_equal_scores", True, "algorithm.filter_groups.enable", "DAPO's dynamic sampling")  # fmt: skip


@rule
def reward_model(v: Values, out: Translation, _: dict) -> None:
    if not v["reward_model.enable"]:
        return
    rm = "reward_model"
    if v[f"{rm}.rollout.name"] != "sglang":
        raise VerlRefused([refusal(f"{rm}.rollout.name", v[f"{rm}.rollout.name"], "sglang (the reward servers are SGLang with --is-embedding)")])  # fmt: skip
    tp = v[f"{rm}.rollout.tensor_model_parallel_size"]
    out.set("reward.model.path", expand(v[f"{rm}.model.path"]), f"{rm}.model.path")
    out.set("reward.model.backend", "sglang", f"{rm}.rollout.name")
    out.set("reward.model.gpus_per_engine", tp, f"{rm}.rollout.tensor_model_parallel_size")
    out.set("reward.model.mem_fraction_static", v[f"{rm}.rollout.gpu_memory_utilization"], f"{rm}.rollout.gpu_memory_utilization")  # fmt: skip
    pool = v[f"{rm}.n_gpus_per_node"] * v[f"{rm}.nnodes"] if v[f"{rm}.enable_resource_pool"] else tp  # fmt: skip
    out.set("reward.model.num_engines", max(1, pool // tp), f"{rm}.enable_resource_pool, n_gpus_per_node, nnodes")  # fmt: skip
    # verl's reward manager returns the model's scores as they are (rm_scores) and skips
    # the rule: the model alone, raw (a fleetrl: section may weigh a rule in, or normalise)
    why = "verl trains on the reward model's score alone"
    out.set("reward.rule_weight", 0.0, f"{rm}.enable", why)
    out.set("reward.model.normalize", False, f"{rm}.enable", f"{why}, raw")
    out.set("reward.model.clip", 0.0, f"{rm}.enable", f"{why}, unclipped")


@rule
def gpus(v: Values, out: Translation, fo: dict) -> None:
    """The split of verl's GPUs between learner ranks and engines (the module docstring)."""
    out.split_decided = True
    if v["trainer.device"] == "cpu":
        out.lines.append("trainer.device=cpu: no GPUs; one learner rank, one engine per fleetrl defaults")  # fmt: skip
        return
    node_gpus, nodes = v["trainer.n_gpus_per_node"], v["trainer.nnodes"]
    total, tp = node_gpus * nodes, v[f"{RO}.tensor_model_parallel_size"]
    reward = 0
    if v["reward_model.enable"] and not v["reward_model.enable_resource_pool"]:
        reward = v["reward_model.rollout.tensor_model_parallel_size"]
    avail = total - reward
    ranks, engines = _get(fo, "learner.num_ranks"), _get(fo, "rollout.num_engines")
    source = "trainer.n_gpus_per_node, trainer.nnodes"
    share, per_rank, per_engine = False, 1.0, float(tp)
    if ranks is None and engines is None:
        if avail == 1 and tp == 1:
            share, ranks, engines, per_rank, per_engine = True, 1, 1, 0.5, 0.5
        else:
            engines = max(1, (avail // 2) // tp)
            ranks = avail - engines * tp
    elif ranks is None:
        ranks = avail - engines * tp
    elif engines is None:
        engines = (avail - ranks) // tp
    if ranks < 1 or engines < 1:
        raise VerlRefused([refusal(
            "trainer.n_gpus_per_node", node_gpus,
            f"more GPUs: {total} ({node_gpus} x {nodes} nodes, {reward} for the reward server) cannot hold "
            f"a learner rank and an engine of tensor_model_parallel_size={tp} on GPUs of their own "
            "(fleetrl.learner.num_ranks / fleetrl.rollout.num_engines choose the split)",
        )])  # fmt: skip
    out.set("learner.num_ranks", ranks, source, "learner ranks, one GPU each")
    out.set("learner.gpus_per_rank", per_rank, source)
    label = engine_kind(v[f"{RO}.name"]).label
    out.set("rollout.num_engines", engines, source, f"{label} engines of {tp} GPUs")
    out.set("rollout.gpus_per_engine", per_engine, f"{RO}.tensor_model_parallel_size")
    if share:
        kind = engine_kind(v[f"{RO}.name"])
        if "gloo" not in kind.sync_backends:
            raise VerlRefused([refusal(
                "trainer.n_gpus_per_node", node_gpus,
                f"2 or more GPUs: {kind.label} engines take weights over NCCL, which needs the "
                "learner rank and the engine on GPUs of their own (or actor_rollout_ref.rollout.name=sglang on one GPU)",
            )])  # fmt: skip
        out.set("weight_sync.backend", "gloo", source, "one GPU for both: NCCL refuses two ranks on one device")  # fmt: skip
        out.lines.append(f"GPUs: verl's 1 GPU is shared: the learner rank and the engine get half each (gpu_memory_utilization={v[f'{RO}.gpu_memory_utilization']} for the engine)")  # fmt: skip
        return
    left = avail - ranks - engines * tp
    out.lines.append(
        f"GPUs: verl's {total} ({node_gpus} x {nodes}) go {ranks} to learner ranks, "
        f"{engines * tp} to {engines} {label} engine(s) of {tp} (tensor_model_parallel_size)"
        + (f", {reward} to the reward server" if reward else "")
        + (f", {left} unused" if left else "")
        + "; verl shares them all between training and rollout, fleetrl gives each its own "
        "(set fleetrl.learner.num_ranks or fleetrl.rollout.num_engines to split otherwise)"
    )


@rule
def micro_batches(v: Values, out: Translation, fo: dict) -> None:
    """verl's micro-batch per GPU, or its deprecated global one divided as verl divides it:
    by the data-parallel learner ranks (ranks / Ulysses group) of the final GPU split."""
    if v[f"{A}.use_dynamic_bsz"]:
        return
    per_gpu, total = v[f"{A}.ppo_micro_batch_size_per_gpu"], v[f"{A}.ppo_micro_batch_size"]
    if per_gpu is None and total is None:
        raise VerlRefused([
            refusal(f"{A}.ppo_micro_batch_size_per_gpu", None,
                    "it (sequences per GPU and micro-batch), or use_dynamic_bsz=true: verl requires one without dynamic batching"),
        ])  # fmt: skip
    if per_gpu is not None:
        out.set("learner.micro_batch_size", per_gpu, f"{A}.ppo_micro_batch_size_per_gpu")
        return
    sp = _get(fo, "learner.sequence_parallel") or v[f"{A}.ulysses_sequence_parallel_size"] or 1
    dp = max(1, out.learner_ranks(fo) // sp)
    out.set(
        "learner.micro_batch_size", max(1, total // dp), f"{A}.ppo_micro_batch_size",
        f"the deprecated global size over {dp} data-parallel learner rank(s)",
    )  # fmt: skip
