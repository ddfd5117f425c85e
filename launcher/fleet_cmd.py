"""`fleetrl fleet scale` and `fleetrl fleet status`: steer and inspect a running job's fleets.

    fleetrl fleet status --run RUN_DIR
    fleetrl fleet scale --run RUN_DIR --engines 3            # the rollout fleet's target
    fleetrl fleet scale --run RUN_DIR --reward-engines 2     # the reward fleet's

Both talk to the run's control endpoint (launcher/fleet_control.py) with the keys in
``RUN_DIR/fleet_control.json``. A target outside the fleet's range (``rollout.min_engines``
.. ``max_engines``, ``reward.model.*``), or a run whose fleet is not elastic, is refused with
one line and exit status 2; a run that does not answer exits 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the handlers: `fleetrl --help` loads no ZeroMQ
    from launcher.fleet_control import FleetState


class ScaleRefusedError(ValueError):
    """The run refused the request: printed as one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", required=True)
    status = sub.add_parser("status", help="each engine's state, node, version and load")
    status.add_argument("--run", required=True, help="the run directory (trainer.output_dir)")
    scale = sub.add_parser(
        "scale", help="set the engine count of a running elastic job (rollout.elastic=true)"
    )
    scale.add_argument("--run", required=True, help="the run directory (trainer.output_dir)")
    scale.add_argument("--engines", type=int, default=None, help="rollout engines to run")
    scale.add_argument(
        "--reward-engines", type=int, default=None, help="reward-model servers to run"
    )


def _ask(run_dir: str, request: Any) -> Any:
    """The run's reply to ``request``; its refusal as ``ScaleRefusedError``; None (after one
    line on stderr) when the run does not answer."""
    from launcher.fleet_control import ControlError, ErrorReply, call

    try:
        reply = call(run_dir, request)
    except ControlError as err:
        print(f"fleetrl: {err}", file=sys.stderr)
        return None
    if isinstance(reply, ErrorReply):
        raise ScaleRefusedError(reply.message)
    return reply


def status(args: argparse.Namespace) -> int:
    from launcher.fleet_control import StatusRequest

    reply = _ask(args.run, StatusRequest())
    if reply is None:
        return 1
    print(f"policy version {reply.policy_version}")
    for fleet in reply.fleets:
        print("\n".join(status_lines(fleet)))
    return 0


def status_lines(fleet: FleetState) -> list[str]:
    """One fleet as a header line and one row per engine."""
    kind = f"elastic, {fleet.min_engines}..{fleet.max_engines}" if fleet.elastic else "fixed"
    lines = [
        f"{fleet.fleet} fleet: {fleet.serving} serving, target {fleet.target} ({kind}); "
        f"joins {fleet.joins}, leaves {fleet.leaves}, lost with their node {fleet.lost}"
    ]
    header = ("engine", "state", "version", "node", "in flight", "groups", "why")
    rows = [
        (
            e.name,
            e.state,
            "-" if e.version is None else str(e.version),
            e.node[:12] or "-",
            str(e.in_flight),
            str(e.groups),
            e.reason,
        )
        for e in fleet.engines
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())  # fmt: skip
    return lines


def scale(args: argparse.Namespace) -> int:
    from launcher.fleet_control import ScaleRequest

    wanted = [("rollout", args.engines), ("reward", args.reward_engines)]
    wanted = [(fleet, n) for fleet, n in wanted if n is not None]
    if not wanted:
        raise ScaleRefusedError("give --engines N and/or --reward-engines N")
    for fleet, engines in wanted:
        reply = _ask(args.run, ScaleRequest(fleet=fleet, engines=engines))
        if reply is None:
            return 1
        print(
            f"{reply.fleet} fleet: target {reply.previous} -> {reply.target} engines "
            f"(range {reply.min_engines}..{reply.max_engines}); {reply.serving} serving now"
        )
    return 0
