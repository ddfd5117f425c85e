"""Ray placement: start or join Ray, and place each role on its kind of node.

Local runs (no address, no RAY_ADDRESS) start a Ray instance in this process
that declares the ``rollout``, ``learner`` and ``reward`` custom resources itself, so the
placement code is the same as on a cluster, where nodes declare them (see
configs/cluster/ and docs/cluster.md). A local instance gets at least as many
logical CPUs as the run asks for: a laptop with fewer cores oversubscribes
(the roles share the cores) instead of waiting forever for resources.

Placement: the learner group is one placement group of ``learner.num_ranks``
bundles on ``learner`` nodes (PACK: ranks close together for collectives);
engines go on ``rollout`` nodes and reward-model servers on ``reward`` nodes (their
fleets place them); the buffer and the rollout supervisor need no CPU of their own
(their work is I/O).

Co-located (``rollout.placement: colocated``): engine i is placed in bundle i of the
learner's placement group, beside learner rank i. The bundle holds the rank's and the
engine's CPUs and the rank's GPU; each of the two actors reserves
``COLOCATED_GPU_SHARE`` of that GPU in Ray's accounting (so Ray shows both the same
device), and they use it in turns (``rollout_fleet.colocation``).

Waiting is bounded and explained: ``wait_for_learner_group`` and
``wait_for_engine_room`` log, every ``PLACEMENT_PROGRESS_S``, what the cluster
still lacks per node (the preflight's placement model run on the resources Ray
reports free), and stop the run after ``ray.placement_timeout_s`` with one line
saying what is missing where.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger, role_env
from fleetrl.machine import usable_cpus
from fleetrl.threads import THREADS_PER_CPU_ENV, threads_per_cpu
from launcher.config import RunConfig
from launcher.local_ray import start_local
from launcher.supervision import TrainingStopped

log = get_logger(__name__)

LOCAL_CUSTOM_UNITS = 1000  # a local instance is both a rollout and a learner node
COLOCATED_GPU_SHARE = 0.5  # of a bundle's GPU, for its learner rank and for its engine
PLACEMENT_PROGRESS_S = 5.0  # a line saying what placement waits for, this often
PLACEMENT_POLL_S = 0.5


class PlacementTimeout(TrainingStopped):
    """A placement was not satisfied within ``ray.placement_timeout_s``."""


def requested_cpus(cfg: RunConfig) -> float:
    """CPUs of every role at once; an elastic fleet counts at its largest (a local instance
    then has room for ``fleetrl fleet scale`` to grow it)."""
    reward = cfg.reward.model
    engines = cfg.rollout.engine_range[1] if cfg.rollout.elastic else cfg.rollout.num_engines
    servers = reward.engine_range[1] if cfg.rollout.elastic else reward.num_engines
    return (
        cfg.learner.num_ranks * cfg.learner.cpus_per_rank
        + engines * cfg.rollout.cpus_per_engine
        + (servers * reward.cpus_per_engine if cfg.reward.places_fleet else 0.0)
    )


RAY_AUTH_MODE = "RAY_AUTH_MODE"  # Ray's variable: token | disabled


def ask_for_token_auth(address: str | None) -> None:
    """Token authentication for a new local instance (no ``address``), asked for explicitly.

    Ray turns it on for a new local instance by default and warns that it did so on every
    start; asking for it (``RAY_AUTH_MODE=token``, a token made once in ~/.ray/auth_token) is
    the same instance, unwarned. Ray reads the variable when it is imported, so this is
    done before: once Ray is imported (a caller's own), or with the user's own setting, Ray
    is left to its default.
    """
    local = not (address or os.environ.get("RAY_ADDRESS"))
    if local and RAY_AUTH_MODE not in os.environ and "ray" not in sys.modules:
        os.environ[RAY_AUTH_MODE] = "token"


def init_ray(cfg: RunConfig, address: str | None) -> bool:
    """Start or join Ray; returns True when this process started a local instance."""
    ask_for_token_auth(address or cfg.ray.address)
    import ray

    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS") or None

    logs = Path(cfg.trainer.output_dir).resolve() / "logs"
    env = {
        "env_vars": {
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            **role_env(cfg.logging.role_console, logs),  # roles: warnings on the console
        }
    }
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        log.info("joined Ray cluster at %s: %s", address, ray.cluster_resources())
        return False
    cores = usable_cpus()  # the affinity mask and cgroup quota, not the host's count
    num_cpus = cfg.ray.num_cpus or max(cores, int(requested_cpus(cfg) + 0.999))
    # the cores no role reserved go to the roles' threads (fleetrl/threads.py)
    env["env_vars"][THREADS_PER_CPU_ENV] = str(threads_per_cpu(cores, requested_cpus(cfg)))
    if num_cpus > cores:
        log.warning(
            "run asks for %.1f CPUs on a %d-core machine: roles will share cores",
            requested_cpus(cfg),
            cores,
        )
    # A local instance's processes inherit the roles' variables from this one (set while
    # ray.init starts them): no runtime environment to make per worker, so the workers Ray
    # starts ahead serve the first actors instead of each actor waiting for a new process.
    with inherited_env(env["env_vars"]):
        start_local(  # once more if Ray's fixed wait for its raylet runs out (a loaded machine)
            lambda: ray.init(
                # "local": a new instance even where `ray start` left a cluster address in
                # /tmp/ray (ray.init() would join that one instead, with other resources)
                address="local",
                logging_level=logging.WARNING,  # Ray's own start-up lines
                num_cpus=num_cpus,
                num_gpus=cfg.ray.num_gpus or None,
                resources={
                    cfg.ray.rollout_resource: LOCAL_CUSTOM_UNITS,
                    cfg.ray.learner_resource: LOCAL_CUSTOM_UNITS,
                    cfg.ray.reward_resource: LOCAL_CUSTOM_UNITS,
                },
                include_dashboard=False,
                log_to_driver=True,
            )
        )
    log.info("started a local Ray instance (%d CPUs)", num_cpus)
    return True


def shutdown_local_ray() -> None:
    """End the local Ray instance this process started, its autoscaler monitor first.

    ``ray.shutdown`` ends the raylet and the GCS before the monitor, whose SIGTERM handler
    then reports its own termination to the GCS that is gone and waits out Ray's second of
    grace before being killed: a second of every run's exit spent on a process a local
    instance never uses (it autoscales nothing). Killed first, it takes milliseconds.
    """
    import ray
    from ray._private import ray_constants, worker

    node = getattr(worker, "_global_node", None)
    if node is not None and ray_constants.PROCESS_TYPE_MONITOR in node.all_processes:
        try:
            node._kill_process_type(ray_constants.PROCESS_TYPE_MONITOR, allow_graceful=False)
        except Exception as err:  # noqa: BLE001 - ray.shutdown below ends it anyway
            log.debug("ending Ray's monitor first failed (%s); ray.shutdown ends it", err)
    ray.shutdown()


@contextmanager
def inherited_env(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` in this process's environment for the block (what it starts inherits
    them), the environment as it was afterwards."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def learner_bundle(cfg: RunConfig) -> dict[str, float]:
    """One learner rank's bundle; co-located, it holds the CPUs of the rank's engine too."""
    cpus = cfg.learner.cpus_per_rank
    if cfg.rollout.colocated:
        cpus += cfg.rollout.cpus_per_engine
    bundle: dict[str, float] = {"CPU": cpus, cfg.ray.learner_resource: 1.0}
    if cfg.learner.gpus_per_rank:
        bundle["GPU"] = cfg.learner.gpus_per_rank
    return bundle


def gpu_share(cfg: RunConfig) -> float:
    """The GPUs a learner rank (and, co-located, its engine) reserve from its bundle: both
    use the whole device, in turns, so in Ray's accounting each takes a share of it."""
    return cfg.learner.gpus_per_rank * (COLOCATED_GPU_SHARE if cfg.rollout.colocated else 1.0)


def learner_placement_group(cfg: RunConfig) -> Any:
    from ray.util.placement_group import placement_group

    bundles = [learner_bundle(cfg) for _ in range(cfg.learner.num_ranks)]
    return placement_group(bundles, strategy="PACK")


def _bundle_strategy(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def bundle_options(pg: Any, index: int, cfg: RunConfig) -> dict[str, Any]:
    return {
        "num_cpus": cfg.learner.cpus_per_rank,
        "num_gpus": gpu_share(cfg),
        "resources": {cfg.ray.learner_resource: 1},
        "scheduling_strategy": _bundle_strategy(pg, index),
    }


def colocated_engine_options(cfg: RunConfig, pg: Any, index: int) -> dict[str, Any]:
    """Resources of co-located engine ``index``: a share of learner rank ``index``'s bundle."""
    return {
        "num_cpus": cfg.rollout.cpus_per_engine,
        "num_gpus": gpu_share(cfg),
        "scheduling_strategy": _bundle_strategy(pg, index),
    }


def free_nodes() -> list[Any]:
    """Live nodes of the joined cluster with the resources still free on each."""
    import ray
    from ray._private.state import available_resources_per_node

    from launcher.preflight_findings import Node

    names = {
        n["NodeID"]: n.get("NodeManagerAddress") or n["NodeID"][:8]
        for n in ray.nodes()
        if n.get("Alive")
    }
    return [
        Node(f"node {names[node_id]}", dict(free))
        for node_id, free in available_resources_per_node().items()
        if node_id in names
    ]


def missing(cfg: RunConfig, parts: tuple[str, ...]) -> str:
    """What the free resources lack for ``parts`` ("learner", "rollout", "reward"), per node."""
    from launcher.preflight_resources import check_resources

    findings = check_resources(cfg, free_nodes(), local=False, parts=parts)
    if not findings:
        return "the resources are free now but not yet granted (see `ray status`)"
    return "; ".join(f"{f.problem} ({f.key})" for f in findings)


def _wait(
    cfg: RunConfig,
    what: str,
    parts: tuple[str, ...],
    done: Callable[[float], bool],
    on_timeout: Callable[[], None] | None = None,
) -> None:
    """Poll ``done(poll_s)`` until true; a progress line every few seconds; stop at the deadline."""
    limit = cfg.ray.placement_timeout_s
    started = last_line = time.monotonic()
    while not done(min(PLACEMENT_POLL_S, max(limit - (time.monotonic() - started), 0.01))):
        now = time.monotonic()
        if now - started >= limit:
            if on_timeout is not None:
                on_timeout()
            raise PlacementTimeout(
                f"{what} was not placed within {limit:.0f}s (ray.placement_timeout_s): "
                f"{missing(cfg, parts)}"
            )
        if now - last_line >= PLACEMENT_PROGRESS_S:
            last_line = now
            log.info("waiting %.0fs of %.0fs to place %s: %s", now - started, limit, what, missing(cfg, parts))  # fmt: skip


def wait_for_learner_group(pg: Any, cfg: RunConfig) -> None:
    """Block until the learner placement group is placed, or raise ``PlacementTimeout``."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ready = pg.ready()

    def placed(timeout_s: float) -> bool:
        return bool(ray.wait([ready], timeout=timeout_s)[0])

    _wait(cfg, "the learner group", ("learner",), placed, lambda: remove_placement_group(pg))


def wait_for_engine_room(cfg: RunConfig) -> None:
    """Block until the free resources fit every engine and reward server, or raise
    ``PlacementTimeout``.

    Engines are placed by the fleets (one actor each); waiting here first, where the
    driver can say what is missing, keeps their own start-up timeout for start-up.
    """
    from launcher.preflight_resources import check_resources

    parts = ("rollout", "reward") if cfg.reward.places_fleet else ("rollout",)

    def room(timeout_s: float) -> bool:
        if not check_resources(cfg, free_nodes(), local=False, parts=parts):
            return True
        time.sleep(timeout_s)
        return False

    _wait(cfg, "the rollout fleet" + (" and the reward fleet" if len(parts) > 1 else ""), parts, room)  # fmt: skip
