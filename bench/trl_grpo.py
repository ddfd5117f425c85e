"""TRL's ``GRPOTrainer`` on a fleetrl run config: the trainer a user would pick instead.

``python -m bench.trl_grpo --config FILE [dotted overrides ...] --out DIR [--threads N]``

The same YAML and overrides ``fleetrl train`` takes are loaded and checked by
fleetrl's own config code, then mapped onto TRL 1.16's ``GRPOConfig`` key for key
(``trl_arguments``): model folder, train Parquet, prompts per step and samples per
prompt, sampling temperature / top-p / top-k, the response cap, AdamW's learning
rate, betas, epsilon and weight decay, the schedule (constant, or cosine to
``min_lr_ratio``, with warm-up), gradient clipping, steps, seed, the PPO clip
range, the loss aggregation (token-mean is TRL's ``dapo``), GRPO's std
normalisation or Dr. GRPO's none, the KL loss and its coefficient. A setting TRL
cannot express (a critic, KL in the reward, RLOO, a reward model or a custom
reward function) stops the run with one line naming the key. The reward is
fleetrl's rule scorer for each row's ``data_source`` (the function the fleet's
workers call), so both trainers are scored by the same code.

TRL at its best on a CPU, as its docs recommend and a user would set it:
``use_cpu``, fp32 (bf16 is GPU advice), no gradient checkpointing (it only
trades speed for memory), no logging or saving besides what is asked, and torch
on every core (``--threads``: torch's default, all of them; set it to try
another). ``--generation continuous`` uses transformers' continuous batching
(``use_transformers_continuous_batching``) instead of ``generate``.

What it writes in ``DIR`` (the layout ``fleetrl train`` writes, so the vs-trl
suite reads both alike): ``metrics.jsonl`` (one row per optimizer step:
``step``, ``time/elapsed_s`` since the process started, ``timing_s/step``),
policy snapshots every ``trainer.save_hf_freq`` steps under ``hf_snapshots/``
(``learner.snapshot.write_hf_snapshot``, the function fleetrl's learner uses, so
a snapshot costs both trainers the same), and ``summary.json`` (import, build
and training seconds). Step 0's snapshot is not written: it is the model folder.

TRL's asynchronous trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer`` in
1.16.0) generates on a vLLM server and syncs weights over NCCL, neither of which
runs on a CPU (DESIGN §13), so it is not run here (``ASYNC_TRAINER_NOTE``).
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.monotonic()  # the whole command's clock (before the heavy imports)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

TRL_VERSION = "1.16.0"  # the release pinned by the `bench` extra
INSTALL_HINT = 'TRL is not installed: pip install ".[bench]" in fleetrl\'s checkout (trl==1.16.0) to run the baseline'
ASYNC_TRAINER_NOTE = (
    "TRL 1.16.0's AsyncGRPOTrainer needs a vLLM server and NCCL weight transfer; neither runs on"
    " a CPU, so only GRPOTrainer is measured here"
)
LOSS_TYPES = {  # fleetrl learner.policy_loss.loss_agg_mode -> TRL loss_type
    "token-mean": "dapo",  # normalised by the active tokens of the whole batch
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
KL_KINDS = ("low_var_kl", "k3")  # TRL's KL loss is the k3 estimator


class Unmappable(ValueError):
    """A fleetrl setting TRL's GRPOTrainer has no equivalent for."""


def trl_available() -> str | None:
    """None when the pinned TRL imports, else the one line saying how to install it."""
    from importlib import metadata

    try:
        version = metadata.version("trl")
    except metadata.PackageNotFoundError:
        return INSTALL_HINT
    if version != TRL_VERSION:
        return (
            f"TRL {version} is installed; the baseline is pinned to {TRL_VERSION}: {INSTALL_HINT}"
        )
    return None


def _refuse(key: str, why: str) -> None:
    raise Unmappable(f"bench.trl_grpo: {key}: {why}")


def check_mappable(cfg: Any) -> None:
    """One line naming the first setting TRL's GRPOTrainer cannot run (else nothing)."""
    learner, reward = cfg.learner, cfg.reward
    if learner.algorithm.adv_estimator not in ("grpo", "drgrpo"):
        _refuse("learner.algorithm.adv_estimator", "TRL's GRPOTrainer has grpo and drgrpo only")
    if learner.policy_loss.loss_agg_mode not in LOSS_TYPES:
        _refuse("learner.policy_loss.loss_agg_mode", f"TRL maps only {sorted(LOSS_TYPES)}")
    if learner.policy_loss.loss_mode != "vanilla":
        _refuse("learner.policy_loss.loss_mode", "only the PPO-clip loss is mapped")
    if learner.kl.use_kl_in_reward:
        _refuse("learner.kl.use_kl_in_reward", "TRL has no KL in the reward")
    if learner.kl.use_kl_loss and learner.kl.kl_kind not in KL_KINDS:
        _refuse("learner.kl.kl_kind", f"TRL's KL loss is k3 ({KL_KINDS})")
    if learner.lora.rank:
        _refuse("learner.lora.rank", "not mapped (peft_config)")
    if learner.policy_loss.entropy_coeff:
        _refuse("learner.policy_loss.entropy_coeff", "not mapped")
    if reward.uses_model or reward.custom_function.path:
        _refuse("reward", "only the rule scorers by data_source are mapped")
    if learner.optim.schedule not in ("constant", "cosine"):
        _refuse("learner.optim.schedule", "constant and cosine are mapped")


def trl_arguments(cfg: Any, out_dir: Path, *, generation: str = "generate") -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments equal to the fleetrl run config ``cfg``."""
    check_mappable(cfg)
    learner, rollout, optim = cfg.learner, cfg.rollout, cfg.learner.optim
    completions = cfg.data.train_batch_size * rollout.n
    minibatches = (
        1
        if learner.ppo_mini_batch_size in (0, cfg.data.train_batch_size)
        else cfg.data.train_batch_size // learner.ppo_mini_batch_size
    )
    schedule: dict[str, Any] = {"lr_scheduler_type": "constant_with_warmup"}
    if optim.schedule == "cosine":
        schedule = {
            "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr_rate": optim.min_lr_ratio},
        }
    algorithm = learner.algorithm
    return {
        "output_dir": str(out_dir / "trl"),
        "seed": cfg.trainer.seed,
        "use_cpu": cfg.trainer.device != "cuda",
        "bf16": False,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "max_steps": cfg.trainer.total_steps,
        # one optimizer step per generated batch (fleetrl: one mini-batch per step), or
        # steps_per_generation mini-batches of it
        "per_device_train_batch_size": completions // minibatches,
        "steps_per_generation": minibatches,
        "gradient_accumulation_steps": 1,
        "num_iterations": learner.ppo_epochs,
        "num_generations": rollout.n,
        "max_completion_length": rollout.max_new_tokens,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": max(rollout.top_k, 0),  # TRL: 0 = off
        "learning_rate": optim.lr,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "adam_epsilon": optim.eps,
        "max_grad_norm": optim.grad_clip,
        "warmup_steps": _warmup(optim, cfg.trainer.total_steps),
        **schedule,
        "epsilon": learner.policy_loss.clip_ratio_low,
        "epsilon_high": learner.policy_loss.clip_ratio_high,
        "loss_type": LOSS_TYPES[learner.policy_loss.loss_agg_mode],
        "scale_rewards": "group"
        if algorithm.adv_estimator == "grpo" and algorithm.norm_by_std
        else "none",
        "beta": learner.kl.kl_loss_coef if learner.kl.use_kl_loss else 0.0,
        "use_transformers_continuous_batching": generation == "continuous",
    }


def _warmup(optim: Any, total_steps: int) -> int:
    from learner.fsdp import warmup_steps

    return warmup_steps(optim, total_steps)


def prompt_rows(train_files: list[str]) -> list[dict[str, Any]]:
    """The train Parquet's rows as TRL reads them: ``prompt`` (chat messages) beside the
    columns the reward needs (``data_source``, ``ground_truth``)."""
    from fleetrl.data.schema import read_rows

    rows = []
    for file in train_files:
        for row in read_rows(file):
            rows.append(
                {
                    "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
                    "data_source": row["data_source"],
                    "ground_truth": str(row["reward_model"]["ground_truth"]),
                }
            )
    return rows


def rule_reward(completions: list[Any], data_source: list[str], ground_truth: list[str], **_: Any):
    """fleetrl's rule score of each completion (TRL passes the dataset's columns by name)."""
    from rollout_fleet.rewards import compute_score

    scores = []
    for completion, source, truth in zip(completions, data_source, ground_truth, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        score = compute_score(source, text, truth)
        scores.append(float(score["score"] if isinstance(score, dict) else score))
    return scores


def _trl_without_vllm() -> None:
    """Tell TRL vLLM is absent. TRL imports vLLM at module level wherever its package is
    found, and this project's virtualenv holds vLLM's code without its dependencies (the vLLM
    conformance tier's, which puts them on its own path); the baseline generates with
    transformers (``use_vllm=False``), so vLLM has nothing to do in it either way."""
    import trl.import_utils as trl_imports

    trl_imports.is_vllm_available = lambda *args, **kwargs: False


def train(cfg: Any, out_dir: Path, *, threads: int | None, generation: str) -> dict[str, Any]:
    """Run GRPOTrainer on ``cfg``; write metrics, snapshots and the summary into ``out_dir``."""
    imported = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    _trl_without_vllm()
    from trl import GRPOConfig, GRPOTrainer

    from learner.snapshot import snapshot_root, write_hf_snapshot

    if threads:
        torch.set_num_threads(threads)
    arguments = trl_arguments(cfg, out_dir, generation=generation)
    model_path = Path(cfg.model.path)
    every = cfg.trainer.save_hf_freq
    metrics_path = out_dir / "metrics.jsonl"
    samples_per_step = cfg.data.train_batch_size * cfg.rollout.n

    class Clock(TrainerCallback):
        """metrics.jsonl rows and policy snapshots, on the training clock."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.monotonic()
            self.file = open(metrics_path, "a")  # noqa: SIM115 - closed on_train_end

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if every > 0 and (step % every == 0 or step == state.max_steps):
                write_hf_snapshot(
                    model.state_dict().items(),
                    model_path=model_path,
                    root=snapshot_root(out_dir),
                    step=step,
                    rank=0,
                )
            now = time.monotonic()
            row = {
                "step": step,
                "time/elapsed_s": now - PROCESS_STARTED,
                "timing_s/step": now - self.last,
                "samples": samples_per_step,
            }
            self.last = now
            self.file.write(json.dumps(row) + "\n")

        def on_train_end(self, args, state, control, **kwargs):
            self.file.close()

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    dataset = Dataset.from_list(prompt_rows(list(cfg.data.train_files)))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[rule_reward],
        args=GRPOConfig(**arguments),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    built = time.monotonic()
    trainer.train()
    finished = time.monotonic()
    summary = {
        "run_dir": str(out_dir),
        "metrics_path": str(metrics_path),
        "import_s": imported - PROCESS_STARTED,
        "build_s": built - imported,
        "train_wall_s": finished - built,
        "threads": torch.get_num_threads(),
        "generation": generation,
        "samples": samples_per_step * cfg.trainer.total_steps,
        "grpo_config": arguments,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trl_grpo", description=__doc__)
    parser.add_argument("--config", required=True, help="a fleetrl run config (YAML)")
    parser.add_argument("--out", required=True, help="the run folder (metrics, snapshots)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--generation", choices=("generate", "continuous"), default="generate")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as fleetrl train takes")
    args = parser.parse_args(argv)
    missing = trl_available()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    from launcher.config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    try:
        check_mappable(cfg)
    except Unmappable as err:
        print(err, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = train(cfg, out, threads=args.threads, generation=args.generation)
    print(json.dumps({k: summary[k] for k in ("import_s", "build_s", "train_wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
