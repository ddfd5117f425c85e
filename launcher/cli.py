"""The ``fleetrl`` command line: one parser, one thin handler per subcommand.

Handlers live next to the code they drive and are imported only after the
arguments are parsed, so ``fleetrl --help`` never imports torch or ray.
A ``ConfigError`` (or any other user-input error a handler raises as
``UsageError``) exits with status 2 and one line, no traceback; a failed preflight
(``launcher.preflight``) with one line per unmet precondition.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from fleetrl.models.config import TINY_FAMILIES

# subcommand path -> "module:function" taking the parsed namespace, returning an exit code
HANDLERS: dict[str, str] = {
    "train": "launcher.train:main",
    "check": "launcher.preflight:main",
    "config show": "launcher.config_cmd:show",
    "plan": "launcher.plan:main",
    "config docs": "launcher.config_cmd:docs",
    "config from-verl": "launcher.verl.from_verl:main",
    "data gsm8k": "fleetrl.data.gsm8k:main",
    "data synth": "fleetrl.data.synth:main",
    "data hh-rlhf": "fleetrl.data.hh_rlhf:main",
    "model tiny": "fleetrl.models.cli:tiny_main",
    "engine": "rollout_fleet.engine.cli:main",
    "buffer": "buffer.service:main",
    "export": "learner.export:main",
    "rm train": "launcher.rm_train:main",
    "rm eval": "launcher.rm_eval:main",
    "eval": "launcher.evaluate:main",
    "weights push": "launcher.weights_push:main",
    "fleet scale": "launcher.fleet_cmd:scale",
    "fleet status": "launcher.fleet_cmd:status",
    "inspect rollouts": "buffer.inspect:main",
    "bench": "bench.cli:main",
}


class UsageError(ValueError):
    """Bad user input detected by a handler: printed as one line, exit status 2."""


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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetrl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from fleetrl import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from rollout_fleet.engine.cli_args import add_engine_arguments  # argparse only

    parser = argparse.ArgumentParser(
        prog="fleetrl", description="Asynchronous actor-learner RL (PPO/GRPO) for language models."
    )
    parser.add_argument("--version", action="version", version=f"fleetrl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train", help="run fleet, buffer, learner group and weight sync end to end on Ray"
    )
    _add_run_args(p, "a new local instance")

    p = sub.add_parser(
        "check",
        help="check every precondition of a run (config, data, reward, resources, backend, "
        "credentials, disk, run folder)",
    )
    _add_run_args(p, "the local instance train would start")

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

    p = sub.add_parser(
        "engine",
        help="serve the embedded SGLang-compatible engine over HTTP (a reward-model folder: /classify)",
    )
    add_engine_arguments(p)

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
    from launcher.rm_eval import add_arguments as add_rm_eval_arguments

    add_rm_eval_arguments(
        rsub.add_parser(
            "eval",
            help="score preference pairs (accuracy, means) or a policy's samples against a rule",
        )
    )

    p = sub.add_parser("export", help="write a Hugging Face folder from a learner checkpoint")
    p.add_argument("--ckpt", required=True, help="a checkpoint folder (RUN_DIR/checkpoints/step_N)")
    p.add_argument("--out", required=True, help="folder to write the Hugging Face model to")
    p.add_argument(
        "--merged",
        action="store_true",
        help="LoRA checkpoints: also write the merged Hugging Face model to OUT/merged",
    )

    p = sub.add_parser("eval", help="score saved policies (snapshots, exports) on the held-out set")
    from launcher.evaluate import add_arguments as add_eval_arguments

    add_eval_arguments(p)
    _add_config_args(p)

    p = sub.add_parser("weights", help="weights of running engines")
    wsub = p.add_subparsers(dest="weights_command", required=True)
    from launcher.weights_push import add_arguments as add_push_arguments

    add_push_arguments(
        wsub.add_parser(
            "push",
            help="load a model folder or learner checkpoint into running engines (SGLang or embedded)",
        )
    )

    p = sub.add_parser("fleet", help="the engine fleets of a running job: status, scale")
    from launcher.fleet_cmd import add_arguments as add_fleet_arguments

    add_fleet_arguments(p)

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

    p = sub.add_parser(
        "bench", help="throughput harness: each stage against its baseline, as ratios"
    )
    p.add_argument(
        "suite",
        choices=[
            "transport",
            "weight-sync",
            "rollout",
            "learner",
            "e2e",
            "accuracy",
            "reward",
            "agent",
            "vs-trl",
            "all",
        ],
        help="the stage to measure against its baseline, or all",
    )
    p.add_argument("--out", required=True, help="folder for the report, figures and plots")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions, and smaller sizes where a suite's figure does not depend on them",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    p.add_argument(
        "--hidden", type=int, nargs="*", default=None, help="model hidden sizes to sweep"
    )
    p.add_argument("--layers", type=int, default=None, help="model layers (default: the suite's)")
    p.add_argument(
        "--engines", type=int, default=None, help="rollout engines (default: the suite's)"
    )
    p.add_argument(
        "--learner-ranks", type=int, default=None, help="learner ranks (default: the suite's)"
    )
    p.add_argument(
        "--batch", type=int, default=None, help="prompts per step (default: the suite's)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per sample (default: the suite's)"
    )
    p.add_argument(
        "--headline-eta",
        type=int,
        default=None,
        help="e2e: the η whose ratio to η = 0 is the headline, declared before the runs (2)",
    )
    p.add_argument(
        "--placement",
        choices=["disaggregated", "colocated"],
        default=None,
        help="e2e: colocated runs co-located engines beside disaggregated ones on the same "
        "resources, alternated, and reports the ratio and the switch's share of a step",
    )
    p.add_argument(
        "--elastic",
        action="store_const",
        const=True,
        default=None,
        help="e2e: one engine at the start joined by more mid-run (fleetrl fleet scale) against "
        "the same engines from the start: samples/s after the join and what it cost the others",
    )
    p.add_argument(
        "--regime",
        choices=["demo", "generation-bound", "both"],
        default=None,
        help="vs-trl: the overhead-bound demo, the generation-bound workload, or both (default)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    return parser


def _handler_key(args: argparse.Namespace) -> str:
    key = args.command
    for attr in (
        "config_command",
        "data_command",
        "model_command",
        "inspect_command",
        "weights_command",
        "rm_command",
        "fleet_command",
    ):
        if getattr(args, attr, None):
            key = f"{key} {getattr(args, attr)}"
    return key


def resolve(key: str) -> Callable[[argparse.Namespace], int]:
    module, _, func = HANDLERS[key].partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fleetrl.config import ConfigError
    from fleetrl.log import setup_logging

    setup_logging(role=args.command)
    try:
        return int(resolve(_handler_key(args))(args) or 0)
    except (ConfigError, UsageError, ValueError, FileNotFoundError) as err:
        # bad input (config, data, checkpoints, paths): one line, no traceback;
        # FLEETRL_DEBUG=1 shows the traceback when the error is a bug, not input
        if os.environ.get("FLEETRL_DEBUG"):
            raise
        for line in getattr(err, "lines", None) or [str(err)]:  # preflight: one per failure
            print(f"fleetrl: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
