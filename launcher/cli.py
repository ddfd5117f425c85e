"""The ``fleetrl`` command line: one parser, one thin handler per subcommand.

Handlers live next to the code they drive and are imported only after the
arguments are parsed, so ``fleetrl --help`` never imports torch or ray.
A ``ConfigError`` (or any other user-input error a handler raises as
``UsageError``) exits with status 2 and one line, no traceback; a failed preflight
(``launcher.preflight``) with one line per unmet precondition.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetrl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from fleetrl import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the top-level options, then each command's parser in turn."""
    from launcher.cli_parsers import COMMANDS

    parser = argparse.ArgumentParser(
        prog="fleetrl", description="Asynchronous actor-learner RL (PPO/GRPO) for language models."
    )
    parser.add_argument("--version", action="version", version=f"fleetrl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(sub)
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


def console() -> NoReturn:
    """The ``fleetrl`` program: ``main()``, then exit without tearing the interpreter down.

    A run's process holds torch, transformers and Ray's client; Python's own teardown of
    their modules takes most of a second after the last line is printed, and nothing of
    it reaches the user. The exit handlers run (Ray's, the trackers'), the streams and
    the log are flushed, then the process ends with ``main()``'s status. A thread that
    is not a daemon still running (a command that left work behind) gets the ordinary
    exit, which waits for it.
    """
    code = main()
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
