"""Preflight's resource check: the learner group's bundles, the engines, then the reward
servers (when the run places them), placed per node.

A rank or an engine fits on one node or not at all, so demand is placed first-fit node by
node on what Ray offers (this machine's local instance, or ``ray.nodes()`` of a cluster),
and a shortfall is reported as the one resource that runs out first, with the config key
that asks for it and the fix (``launcher.placement`` reuses it to say why a placement
group waits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from launcher.config import RunConfig
from launcher.placement import LOCAL_CUSTOM_UNITS, learner_bundle, requested_cpus
from launcher.preflight_findings import Finding, Node, Probes, _num
from rollout_fleet.actors import NODE_MARKER_SHARE


def engine_demand(cfg: RunConfig) -> dict[str, float]:
    """One engine actor's resources, as rollout_fleet.actors asks for them."""
    demand = {"CPU": cfg.rollout.cpus_per_engine, cfg.ray.rollout_resource: NODE_MARKER_SHARE}
    if cfg.rollout.gpus_per_engine:
        demand["GPU"] = cfg.rollout.gpus_per_engine
    return demand


def reward_server_demand(cfg: RunConfig) -> dict[str, float]:
    """One reward server's resources, as rollout_fleet.rewards.fleet asks for them."""
    model = cfg.reward.model
    demand = {"CPU": model.cpus_per_engine, cfg.ray.reward_resource: NODE_MARKER_SHARE}
    if model.gpus_per_engine:
        demand["GPU"] = model.gpus_per_engine
    return demand


def needs_gpus(cfg: RunConfig) -> bool:
    reward_gpus = cfg.reward.places_fleet and cfg.reward.model.gpus_per_engine
    return bool(cfg.learner.gpus_per_rank or cfg.rollout.gpus_per_engine or reward_gpus)


def local_node(cfg: RunConfig, probes: Probes) -> Node:
    """The node a local instance started by launcher.placement.init_ray would offer."""
    cpus = cfg.ray.num_cpus or max(probes.cpu_count(), math.ceil(requested_cpus(cfg)))
    gpus = cfg.ray.num_gpus or (probes.cuda_devices() if needs_gpus(cfg) else 0)
    return Node(
        "the local Ray instance",
        {
            "CPU": float(cpus),
            "GPU": float(gpus),
            cfg.ray.rollout_resource: float(LOCAL_CUSTOM_UNITS),
            cfg.ray.learner_resource: float(LOCAL_CUSTOM_UNITS),
            cfg.ray.reward_resource: float(LOCAL_CUSTOM_UNITS),
        },
    )


def _fits(demand: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in demand.items())


def place(demand: Mapping[str, float], count: int, free: list[dict[str, float]]) -> int:
    """First-fit ``count`` copies of ``demand`` onto ``free`` (updated in place); how many fit."""
    placed = 0
    for _ in range(count):
        node = next((f for f in free if _fits(demand, f)), None)
        if node is None:
            break
        for k, v in demand.items():
            node[k] -= v
        placed += 1
    return placed


def shortfall(
    what: str,
    unit: str,
    demand: Mapping[str, float],
    count: int,
    nodes: list[Node],
    free: list[dict[str, float]],
    keys: Mapping[str, str],
    fixes: Mapping[str, str],
) -> Finding | None:
    """Place ``count`` copies of ``demand``; a Finding naming the resource that runs out, if any."""
    before = [dict(f) for f in free]
    placed = place(demand, count, free)
    if placed == count:
        return None
    marker = next(k for k in demand if k not in ("CPU", "GPU"))
    marked = [(n, f) for n, f in zip(nodes, before, strict=True) if f.get(marker, 0.0) > 0]
    shape = ", ".join(f"{k} {_num(v)}" for k, v in demand.items() if k != marker)
    need = f"{what} needs {count} {unit if count != 1 else unit[:-1]} × {{{shape}}} on '{marker}' nodes, {placed} fit"
    if not marked:
        return Finding(
            key=keys["marker"],
            problem=f"{need}: no node offers the '{marker}' resource",
            fix=fixes["marker"],
        )
    # the binding resource: the one whose per-node supply runs out first
    limits = {
        k: sum(int((f.get(k, 0.0) + 1e-9) // v) for _, f in marked)
        for k, v in demand.items()
        if v > 0
    }
    binding = min(limits, key=lambda k: limits[k])
    largest = max(f.get(binding, 0.0) for _, f in marked)
    if 0 < largest < demand[binding]:  # a rank or an engine never spans nodes
        short = (
            f"one needs {_num(demand[binding])} {binding} on one node, "
            f"the largest '{marker}' node has {_num(largest)}"
        )
    else:
        total = sum(f.get(binding, 0.0) for _, f in marked)
        short = f"{_num(demand[binding] * count)} {binding} needed, {_num(total)} there"
    offers = "; ".join(
        f"{n.name} has {', '.join(f'{k} {_num(n.resources.get(k, 0.0))}' for k in ('GPU', 'CPU'))}"
        for n, _ in marked[:3]
    ) + ("; ..." if len(marked) > 3 else "")
    kind = binding if binding in ("CPU", "GPU") else "marker"
    return Finding(
        key=keys[kind],
        problem=f"{need}: not enough {binding} ({short}; {offers})",
        fix=fixes[kind],
    )


def check_resources(
    cfg: RunConfig,
    nodes: list[Node],
    *,
    local: bool,
    autoscaling: bool = False,
    parts: tuple[str, ...] = ("learner", "rollout", "reward"),
) -> list[Finding]:
    """The learner group, the engines, then the reward servers (when the run places them),
    placed per node on what ``nodes`` offer."""
    free = [dict(n.resources) for n in nodes]
    found = []
    # (part, what, unit, demand, count, key of each resource, key of the count, marker);
    # co-located engines live in the learner's bundles: only a mixed run's remote ones count
    engines = cfg.rollout.num_engines - cfg.rollout.colocated_engines
    groups = [
        ("learner", "the learner group", "ranks", learner_bundle(cfg), cfg.learner.num_ranks,
         "learner.{}_per_rank", "learner.num_ranks", cfg.ray.learner_resource, "ray.learner_resource"),
        ("rollout", "the rollout fleet", "engines", engine_demand(cfg), engines,
         "rollout.{}_per_engine", "rollout.num_engines", cfg.ray.rollout_resource, "ray.rollout_resource"),
    ]  # fmt: skip
    if cfg.reward.places_fleet:
        groups.append(
            ("reward", "the reward fleet", "servers", reward_server_demand(cfg),
             cfg.reward.model.num_engines, "reward.model.{}_per_engine",
             "reward.model.num_engines", cfg.ray.reward_resource, "ray.reward_resource")
        )  # fmt: skip
    for part, what, unit, demand, count, per_key, count_key, marker, marker_key in groups:
        if part not in parts or count == 0:
            continue
        keys = {"GPU": per_key.format("gpus"), "CPU": per_key.format("cpus"), "marker": marker_key}
        if local:
            fixes = {
                "GPU": f"run on GPU machines (--address), set ray.num_gpus if Ray misses GPUs, or {keys['GPU']}=0 for a CPU run",  # fmt: skip
                "CPU": f"raise ray.num_cpus (0 = every core), or lower {keys['CPU']} or {count_key}",
                "marker": f"lower {count_key} (a local instance offers {LOCAL_CUSTOM_UNITS} '{marker}')",
            }
        else:
            later = "" if autoscaling else "; set ray.autoscaling=true if the cluster starts nodes on demand"  # fmt: skip
            fixes = {
                k: f"add '{marker}' nodes with more {k} (ray start --resources '{{\"{marker}\": N}}'), or lower {keys[k]} or {count_key}{later}"  # fmt: skip
                for k in ("GPU", "CPU")
            }
            fixes["marker"] = (
                f"start {part} nodes with ray start --resources '{{\"{marker}\": N}}', "
                f"or set {marker_key} to the name your nodes declare{later}"
            )
        finding = shortfall(what, unit, demand, count, nodes, free, keys, fixes)
        if finding is not None:
            found.append(msgspec.structs.replace(finding, fatal=not autoscaling))
    return found
