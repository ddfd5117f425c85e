"""Ray placement: start or join Ray, and place each role on its kind of node.

Local runs (no address, no RAY_ADDRESS) start a Ray instance in this process
that declares the ``rollout`` and ``learner`` custom resources itself, so the
placement code is the same as on a cluster, where nodes declare them (see
configs/cluster/ and docs/cluster.md). A local instance gets at least as many
logical CPUs as the run asks for: a laptop with fewer cores oversubscribes
(the roles share the cores) instead of waiting forever for resources.

Placement: the learner group is one placement group of ``learner.num_ranks``
bundles on ``learner`` nodes (PACK: ranks close together for collectives);
engines go on ``rollout`` nodes (the fleet places them); the buffer and the
rollout supervisor need no CPU of their own (their work is I/O).
"""

from __future__ import annotations

import os
from typing import Any

from fleetrl.log import get_logger
from launcher.config import RunConfig

log = get_logger(__name__)

LOCAL_CUSTOM_UNITS = 1000  # a local instance is both a rollout and a learner node


def requested_cpus(cfg: RunConfig) -> float:
    return (
        cfg.learner.num_ranks * cfg.learner.cpus_per_rank
        + cfg.rollout.num_engines * cfg.rollout.cpus_per_engine
    )


def init_ray(cfg: RunConfig, address: str | None) -> bool:
    """Start or join Ray; returns True when this process started a local instance."""
    import ray

    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        log.info("joined Ray cluster at %s: %s", address, ray.cluster_resources())
        return False
    cores = os.cpu_count() or 1
    num_cpus = cfg.ray.num_cpus or max(cores, int(requested_cpus(cfg) + 0.999))
    if num_cpus > cores:
        log.warning(
            "run asks for %.1f CPUs on a %d-core machine: roles will share cores",
            requested_cpus(cfg),
            cores,
        )
    ray.init(
        # "local": always a new instance; without it Ray joins any cluster a `ray start`
        # on this machine recorded in /tmp/ray, and then refuses num_cpus and resources
        address="local",
        num_cpus=num_cpus,
        num_gpus=cfg.ray.num_gpus or None,
        resources={
            cfg.ray.rollout_resource: LOCAL_CUSTOM_UNITS,
            cfg.ray.learner_resource: LOCAL_CUSTOM_UNITS,
        },
        include_dashboard=False,
        runtime_env=env,
        log_to_driver=True,
    )
    log.info("started a local Ray instance (%d CPUs)", num_cpus)
    return True


def learner_placement_group(cfg: RunConfig) -> Any:
    from ray.util.placement_group import placement_group

    bundle: dict[str, float] = {"CPU": cfg.learner.cpus_per_rank, cfg.ray.learner_resource: 1}
    if cfg.learner.gpus_per_rank:
        bundle["GPU"] = cfg.learner.gpus_per_rank
    pg = placement_group([dict(bundle) for _ in range(cfg.learner.num_ranks)], strategy="PACK")
    return pg


def bundle_options(pg: Any, index: int, cfg: RunConfig) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": cfg.learner.cpus_per_rank,
        "num_gpus": cfg.learner.gpus_per_rank,
        "resources": {cfg.ray.learner_resource: 1},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
    }
