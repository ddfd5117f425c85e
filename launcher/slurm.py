"""The node plan of a Slurm job that runs a Ray cluster (scripts/slurm/fleetrl.sbatch).

The job's first node runs the Ray head and the driver; every other node joins as a Ray
worker marked with the custom resources of the roles it serves (``rollout``, ``learner``,
``reward``: docs/cluster.md). Which node serves which role comes from three variables,
each a count of nodes, a Slurm host list, or ``rest``:

    FLEETRL_LEARNER_NODES   default 1      FLEETRL_REWARD_NODES   default 0
    FLEETRL_ROLLOUT_NODES   default rest

A count takes the next worker nodes in the job's order (learner first, then reward, then
rollout); a host list names nodes (the head may be among them, and a node named in two
lists serves both); ``rest`` is every worker node no other list took. Each role gets
``FLEETRL_UNITS_PER_NODE`` units on each of its nodes (default: the node's GPUs as Slurm
counts them, ``SLURM_GPUS_ON_NODE``, or 1 where it has none), one unit per GPU as in the
cluster configs.

    python -m launcher.slurm plan --head NODE --nodes "NODE..."   one line per node: NAME JSON
    python -m launcher.slurm wait --address HOST:PORT --nodes N  until N Ray nodes are alive
                                                                  (then one line for each)

A plan that cannot be met (a count larger than the nodes left, a host outside the job, a
role with no node) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from launcher.config import RayConfig

ROLE_VARIABLES = {  # role -> (variable, default), in the order counts take nodes
    "learner": ("FLEETRL_LEARNER_NODES", "1"),
    "reward": ("FLEETRL_REWARD_NODES", "0"),
    "rollout": ("FLEETRL_ROLLOUT_NODES", "rest"),
}


class PlanError(ValueError):
    """A node plan that the job's nodes cannot meet: one line, exit status 2."""


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's own expansion of a host list (``gpu[01-03],cpu1``)."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def _resource_names() -> dict[str, str]:
    defaults = RayConfig()
    return {
        "rollout": defaults.rollout_resource,
        "learner": defaults.learner_resource,
        "reward": defaults.reward_resource,
    }


def node_roles(
    head: str,
    nodes: list[str],
    env: Mapping[str, str],
    expand: Callable[[str], list[str]] = expand_hostlist,
) -> dict[str, list[str]]:
    """Each node of the job -> the roles it serves, in the job's node order."""
    workers = [n for n in nodes if n != head]
    taken: set[str] = set()
    roles: dict[str, list[str]] = {n: [] for n in nodes}
    rest_roles = []
    for role, (variable, default) in ROLE_VARIABLES.items():
        spec = env.get(variable, default).strip()
        if spec == "rest":
            rest_roles.append(role)
            continue
        if spec.isdigit():
            free = [n for n in workers if n not in taken]
            if int(spec) > len(free):
                raise PlanError(
                    f"{variable}={spec}: only {len(free)} worker node(s) left of "
                    f"{len(workers)} ({' '.join(workers) or 'none'}); ask sbatch for more nodes "
                    "(-N) or give fewer"
                )
            chosen = free[: int(spec)]
        else:
            chosen = expand(spec)
            outside = [n for n in chosen if n not in roles]
            if outside:
                raise PlanError(
                    f"{variable}={spec}: {' '.join(outside)} not in this job's nodes "
                    f"({' '.join(nodes)})"
                )
        taken.update(chosen)
        for node in chosen:
            roles[node].append(role)
    for role in rest_roles:
        for node in workers:
            if node not in taken:
                roles[node].append(role)
    for role, (variable, _) in ROLE_VARIABLES.items():
        if role != "reward" and not any(role in r for r in roles.values()):
            raise PlanError(
                f"{variable}: no node serves the {role} role (nodes: {' '.join(nodes)}); "
                "ask sbatch for more nodes (-N) or name one"
            )
    return roles


def units_per_node(env: Mapping[str, str]) -> int:
    raw = env.get("FLEETRL_UNITS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE") or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise PlanError(f"FLEETRL_UNITS_PER_NODE={raw}: a whole number of at least 1")
    return int(raw)


def plan(head: str, nodes: list[str], env: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Each node -> the Ray custom resources it starts with."""
    names = _resource_names()
    units = units_per_node(env)
    return {
        node: {names[role]: units for role in roles}
        for node, roles in node_roles(head, nodes, env).items()
    }


def wait_for_nodes(address: str, count: int, timeout_s: float) -> None:
    """Block until ``count`` Ray nodes are alive in the cluster at ``address``."""
    import ray

    shown = {*_resource_names().values(), "CPU", "GPU"}
    deadline = time.monotonic() + timeout_s
    while True:  # the head's GCS may still be starting
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except ConnectionError as err:
            if time.monotonic() > deadline:
                raise PlanError(f"no Ray head answered at {address} in {timeout_s:.0f}s") from err
            time.sleep(2)
    try:
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= count:
                for node in alive:
                    custom = {k: v for k, v in node["Resources"].items() if k in shown}
                    print(f"ray node {node['NodeManagerAddress']} alive, resources {custom}")
                return
            if time.monotonic() > deadline:
                raise PlanError(
                    f"{len(alive)} of {count} Ray nodes joined {address} in {timeout_s:.0f}s"
                )
            time.sleep(1)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.slurm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan", help="one line per node: NAME and its resources as JSON")
    p_plan.add_argument("--head", required=True)
    p_plan.add_argument("--nodes", required=True, help="the job's nodes, space-separated")
    p_wait = sub.add_parser("wait", help="wait until N Ray nodes are alive")
    p_wait.add_argument("--address", required=True)
    p_wait.add_argument("--nodes", type=int, required=True)
    p_wait.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            for node, resources in plan(args.head, args.nodes.split(), os.environ).items():
                print(node, json.dumps(resources, separators=(",", ":")))
        else:
            wait_for_nodes(args.address, args.nodes, args.timeout)
    except (PlanError, subprocess.CalledProcessError) as err:
        print(f"fleetrl slurm: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
