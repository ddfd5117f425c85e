"""`fleetrl model tiny`: write a tiny random-init Hugging Face model folder."""

from __future__ import annotations

import argparse

from fleetrl.log import get_logger
from fleetrl.models.tiny import make_tiny_model

log = get_logger(__name__)


def tiny_main(args: argparse.Namespace) -> int:
    out = make_tiny_model(
        args.out,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        max_positions=args.max_positions,
        seed=args.seed,
        reward_model=args.reward_model,
    )
    kind = "reward model (one-label sequence classifier)" if args.reward_model else "model"
    log.info("wrote tiny %s %s to %s", args.arch, kind, out)
    return 0
