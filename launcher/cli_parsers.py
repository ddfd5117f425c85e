"""The parser of each ``fleetrl`` command, one function per command (``launcher.cli``).

Each function adds its command to the top-level subparsers: its help line, its
arguments and, for a command group, its subcommands. Only argparse is imported
here, so ``fleetrl --help`` stays instant; commands whose handler module is itself
import-light keep their arguments beside the handler (``add_arguments``).
"""

from __future__ import annotations

import argparse

from fleetrl.models.config import TINY_FAMILIES

Subparsers = argparse._SubParsersAction

RUN_OVERRIDES = "learner.optim.lr=1e-6 rollout.n=8"  # keys of a run config (docs/configuration.md)
RM_OVERRIDES = "learner.optim.lr=1e-5 data.train_batch_size=32"  # keys `rm train` reads


def _add_config_args(p: argparse.ArgumentParser, example: str = RUN_OVERRIDES) -> None:
    p.add_argument("--config", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")


def _add_run_args(p: argparse.ArgumentParser, what: str) -> None:
    """What `train` and `check` share: the config, the Ray address, the run folder's rule."""
    _add_config_args(p)
    p.add_argument(
        "--address",
        default=None,
        help=f"Ray cluster address (default: RAY_ADDRESS or {what})",
    )
    p.add_argument(
        "--resume-with-changes",
        action="store_true",
        help="continue the run in trainer.output_dir although its config.yaml differs in keys "
        "that change the run (the earlier config.yaml is kept beside the new one)",
    )


def add_train(sub: Subparsers) -> None:
    """``fleetrl train``: a whole run on Ray."""
    p = sub.add_parser(
        "train", help="run fleet, buffer, learner group and weight sync end to end on Ray"
    )
    _add_run_args(p, "a new local instance")


def add_check(sub: Subparsers) -> None:
    """``fleetrl check``: every precondition of a run, without starting it."""
    p = sub.add_parser(
        "check",
        help="check every precondition of a run (config, data, reward, resources, backend, "
        "credentials, disk, run folder)",
    )
    _add_run_args(p, "the local instance train would start")


def add_plan(sub: Subparsers) -> None:
    """``fleetrl plan``: the memory plan of a config."""
    p = sub.add_parser(
        "plan", help="memory per device and role for a config, before launch (exit 1: does not fit)"
    )
    _add_config_args(p)
    p.add_argument(
        "--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU in GiB (default 80)"
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="a config.json to plan with instead of model.path's (weights not on disk yet)",
    )


def add_config(sub: Subparsers) -> None:
    """``fleetrl config show|docs|from-verl``: the resolved config, its reference, verl files."""
    p = sub.add_parser("config", help="inspect configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    _add_config_args(csub.add_parser("show", help="print the resolved config as YAML"))
    d = csub.add_parser("docs", help="write the configuration reference (Markdown)")
    d.add_argument("--out", default=None, help="file to write (default: stdout)")
    d.add_argument(
        "--verl", action="store_true", help="the verl key mapping (docs/verl.md) instead"
    )
    v = csub.add_parser(
        "from-verl", help="write a verl config (ppo_trainer.yaml layout) as a fleetrl YAML file"
    )
    v.add_argument("input", help="the verl YAML file")
    v.add_argument("overrides", nargs="*", help="dotted verl (or fleetrl) overrides")
    v.add_argument("--out", default=None, help="file to write (default: stdout)")


def add_data(sub: Subparsers) -> None:
    """``fleetrl data gsm8k|synth|hh-rlhf``: datasets in verl's Parquet schema."""
    p = sub.add_parser("data", help="prepare datasets (verl Parquet schema)")
    dsub = p.add_subparsers(dest="data_command", required=True)
    g = dsub.add_parser("gsm8k", help="convert local GSM8K files to train/test Parquet")
    g.add_argument(
        "--input",
        required=True,
        help="folder or file(s) with GSM8K jsonl/parquet (question, answer)",
    )
    g.add_argument("--out", required=True, help="output folder")
    s = dsub.add_parser("synth", help="generate the project's synthetic verifiable tasks")
    s.add_argument("--task", default="add", help="task name (see fleetrl.data.synth.TASKS)")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--train-size", type=int, default=2000, help="train rows (default 2000)")
    s.add_argument("--test-size", type=int, default=200, help="held-out rows (default 200)")
    s.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    h = dsub.add_parser(
        "hh-rlhf",
        help="convert local Anthropic HH-RLHF files (jsonl[.gz]) to preference Parquet",
    )
    h.add_argument(
        "--input", required=True, help="HH-RLHF folder (subsets included) or one jsonl[.gz] file"
    )
    h.add_argument("--out", required=True, help="output folder (train.parquet, test.parquet)")


def add_model(sub: Subparsers) -> None:
    """``fleetrl model tiny``: a tiny random-init model folder."""
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_command", required=True)
    t = msub.add_parser("tiny", help="write a tiny random-init Hugging Face model folder")
    t.add_argument("--out", required=True, help="folder to write")
    t.add_argument(
        "--family",
        "--arch",
        dest="arch",
        default="qwen2",
        choices=TINY_FAMILIES,
        help="model family: its block layout and a tokenizer in its style (default qwen2)",
    )
    t.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    t.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    t.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    t.add_argument(
        "--max-positions", type=int, default=256, help="context length in tokens (default 256)"
    )
    t.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    t.add_argument(
        "--reward-model",
        action="store_true",
        help="a one-label *ForSequenceClassification folder (a random reward model)",
    )


def add_engine(sub: Subparsers) -> None:
    """``fleetrl engine``: the embedded engine's HTTP server (arguments beside the engine)."""
    from rollout_fleet.engine.cli_args import add_engine_arguments  # argparse only

    p = sub.add_parser(
        "engine",
        help="serve the embedded SGLang-compatible engine over HTTP (a reward-model folder: /classify)",
    )
    add_engine_arguments(p)


def add_buffer(sub: Subparsers) -> None:
    """``fleetrl buffer``: the replay buffer service on its own."""
    p = sub.add_parser("buffer", help="run the replay buffer service standalone")
    p.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="ingest (PULL) address; control ROUTER binds port+1",
    )
    p.add_argument(
        "--bank-dir",
        default="",
        help="rollout bank folder (default: buffer.bank_dir, else ./rollout_bank)",
    )
    _add_config_args(p)


def add_rm(sub: Subparsers) -> None:
    """``fleetrl rm train|eval``: reward models (eval's arguments beside ``launcher.rm_eval``)."""
    from launcher.rm_eval import add_arguments as add_rm_eval_arguments

    p = sub.add_parser("rm", help="reward models: train one on preference pairs, evaluate one")
    rsub = p.add_subparsers(dest="rm_command", required=True)
    r = rsub.add_parser(
        "train", help="Bradley-Terry reward-model training on the FSDP2 learner group (Ray)"
    )
    _add_config_args(r, RM_OVERRIDES)
    r.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: RAY_ADDRESS or a new local instance)",
    )
    add_rm_eval_arguments(
        rsub.add_parser(
            "eval",
            help="score preference pairs (accuracy, means) or a policy's samples against a rule",
        )
    )


def add_export(sub: Subparsers) -> None:
    """``fleetrl export``: a Hugging Face folder from a learner checkpoint."""
    p = sub.add_parser("export", help="write a Hugging Face folder from a learner checkpoint")
    p.add_argument("--ckpt", required=True, help="a checkpoint folder (RUN_DIR/checkpoints/step_N)")
    p.add_argument("--out", required=True, help="folder to write the Hugging Face model to")
    p.add_argument(
        "--merged",
        action="store_true",
        help="LoRA checkpoints: also write the merged Hugging Face model to OUT/merged",
    )


def add_eval(sub: Subparsers) -> None:
    """``fleetrl eval``: saved policies on the held-out set (arguments beside the handler)."""
    from launcher.evaluate import add_arguments as add_eval_arguments

    p = sub.add_parser("eval", help="score saved policies (snapshots, exports) on the held-out set")
    add_eval_arguments(p)
    _add_config_args(p)


def add_weights(sub: Subparsers) -> None:
    """``fleetrl weights push``: weights into running engines (arguments beside the handler)."""
    from launcher.weights_push import add_arguments as add_push_arguments

    p = sub.add_parser("weights", help="weights of running engines")
    wsub = p.add_subparsers(dest="weights_command", required=True)
    add_push_arguments(
        wsub.add_parser(
            "push",
            help="load a model folder or learner checkpoint into running engines (SGLang or embedded)",
        )
    )


def add_fleet(sub: Subparsers) -> None:
    """``fleetrl fleet status|scale``: a running job's engines (arguments beside the handler)."""
    from launcher.fleet_cmd import add_arguments as add_fleet_arguments

    p = sub.add_parser("fleet", help="the engine fleets of a running job: status, scale")
    add_fleet_arguments(p)


def add_inspect(sub: Subparsers) -> None:
    """``fleetrl inspect rollouts``: a rollout bank's contents."""
    p = sub.add_parser("inspect", help="inspect run artefacts")
    isub = p.add_subparsers(dest="inspect_command", required=True)
    r = isub.add_parser(
        "rollouts", help="counts and reward/length/staleness statistics of a rollout bank"
    )
    r.add_argument("dir", help="a run folder (its rollout_bank/ is read) or a rollout bank")
    r.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per accepted trajectory: token_ids, loss_mask, logprobs, versions, "
        "reward, episode, ...",
    )


def add_bench(sub: Subparsers) -> None:
    """``fleetrl bench SUITE``: the throughput harness (arguments beside it, ``bench.cli``)."""
    from bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(
        sub.add_parser(
            "bench", help="throughput harness: each stage against its baseline, as ratios"
        )
    )


# in the order `fleetrl --help` lists them
COMMANDS = (
    add_train,
    add_check,
    add_plan,
    add_config,
    add_data,
    add_model,
    add_engine,
    add_buffer,
    add_rm,
    add_export,
    add_eval,
    add_weights,
    add_fleet,
    add_inspect,
    add_bench,
)
