"""The options of ``fleetrl engine``, declared once for both of its entry points.

``launcher/cli.py`` builds ``fleetrl``'s parser before importing anything heavy, and
``python -m rollout_fleet.engine.cli`` parses alone: both call ``add_engine_arguments``.
This module imports nothing but argparse, so ``fleetrl --help`` stays instant.
"""

from __future__ import annotations

import argparse

DEFAULT_MAX_BATCH_TOKENS = 16384  # rollout_fleet.engine.score_runner.MAX_BATCH_TOKENS


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback)"
    )
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer key (required when --host is not loopback; or FLEETRL_API_KEY)",
    )
    p.add_argument(
        "--engine-id", default="engine-0", help="name in logs and replies (default engine-0)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="sequences decoded together; for a reward model, inputs scored together",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="reward model: padded tokens (rows × longest row) in one forward",
    )
    p.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="free released memory on /release_memory_occupation (SGLang's flag; co-located runs)",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="reward model: log one line per scored input (rid, length), as SGLang's --log-requests",
    )
