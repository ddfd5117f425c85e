"""The reward fleet: ``reward.model.num_engines`` reward-model servers, placed, watched, replaced.

Started for ``reward.model.path`` when ``reward.model.urls`` is empty. The servers are the
rollout fleet's machinery with other specs (``rollout_fleet.fleet.EngineFleet.of_specs``):
one Ray actor each, on nodes carrying ``ray.reward_resource``, health-checked and replaced
with the rollout section's health settings, in a ``Membership`` of their own. They serve
the folder's weights from the start and never take a weight push, so every server is READY
as soon as it answers. Backends (``reward.model.backend``, ``auto`` = ``rollout.backend``):

- ``embedded``: the embedded engine, which serves a ``*ForSequenceClassification`` folder on
  ``/classify`` (``rollout_fleet.engine.reward_server``), on the CPU unless the servers get
  GPUs (``gpus_per_engine``);
- ``sglang``: SGLang with ``--is-embedding --load-format auto``, tensor parallel over
  ``gpus_per_engine`` GPUs, ``mem_fraction_static`` and ``sglang_extra_args`` of its own.

Off loopback the servers bind the node's IP and require the run's API key, which the
client sends. Whoever scores (``RewardModelClient``) learns the serving URLs through
``on_servers``: called with every serving server (name -> URL) whenever one starts,
dies or is replaced, so a replacement's new port reaches the client before its next batch.

With ``rollout.elastic`` the reward fleet grows and shrinks as the rollout fleet does,
between ``reward.model.min_engines`` and ``max_engines``, on ``reward`` nodes
(``rollout_fleet.elastic``; servers it adds are ``reward-<i>`` too). Left out: sharing
reward servers between runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from fleetrl.log import get_logger
from fleetrl.threads import role_threads
from rollout_fleet.actors import EngineSpec
from rollout_fleet.config import RolloutConfig
from rollout_fleet.engine_kinds import engine_kind
from rollout_fleet.fleet import EngineFleet, FleetSettings, HealthProbe
from rollout_fleet.membership import SERVING, Membership, MembershipEvent
from rollout_fleet.rewards.config import RewardModelConfig

log = get_logger(__name__)

NAME_PREFIX = "reward"
METRICS_PREFIX = "reward_fleet"


def reward_backend(model: RewardModelConfig, rollout: RolloutConfig) -> str:
    """``reward.model.backend`` with ``auto`` resolved by ``rollout.backend``: the embedded
    engine beside embedded engines, SGLang beside GPU servers (SGLang's or vLLM's: reward
    servers speak SGLang's ``/classify``)."""
    if model.backend != "auto":
        return model.backend
    return "sglang" if engine_kind(rollout.backend).gpu_server else "embedded"


def reward_server_specs(
    model: RewardModelConfig,
    rollout: RolloutConfig,
    *,
    dtype: str = "float32",
    api_key: str | None = None,
    expose_on_node_ip: bool = False,
    log_dir: str | None = None,
) -> list[EngineSpec]:
    """One ``EngineSpec`` per reward server (``reward-0`` ... ``reward-{N-1}``)."""
    return [
        reward_server_spec(
            model,
            rollout,
            f"{NAME_PREFIX}-{i}",
            dtype=dtype,
            api_key=api_key,
            expose_on_node_ip=expose_on_node_ip,
            log_dir=log_dir,
        )
        for i in range(model.num_engines)
    ]


def reward_server_spec(
    model: RewardModelConfig,
    rollout: RolloutConfig,
    name: str,
    *,
    dtype: str = "float32",
    api_key: str | None = None,
    expose_on_node_ip: bool = False,
    log_dir: str | None = None,
) -> EngineSpec:
    """The ``EngineSpec`` of reward server ``name``."""
    backend = reward_backend(model, rollout)
    gpus = model.gpus_per_engine
    return EngineSpec(
        name=name,
        model_path=model.path,
        backend=backend,  # type: ignore[arg-type]
        device="cuda" if gpus > 0 else "cpu",
        dtype=dtype,
        # embedded: a client batch is one forward; SGLang sizes its own from memory
        max_running_requests=None if engine_kind(backend).gpu_server else model.batch_size,
        expose_on_node_ip=expose_on_node_ip,
        api_key=api_key,
        torch_threads=role_threads(model.cpus_per_engine),
        tp_size=max(1, int(gpus)) if engine_kind(backend).gpu_server else 1,
        mem_fraction_static=model.mem_fraction_static,
        load_format="auto",  # its own weights, from the folder: never pushed
        is_embedding=True,
        extra_args=list(model.sglang_extra_args),
        startup_timeout_s=rollout.engine_startup_timeout_s,
        log_dir=log_dir,
    )


def reward_fleet_settings(model: RewardModelConfig, rollout: RolloutConfig) -> FleetSettings:
    """Supervision of the reward servers: their own counts and resources, the rollout
    section's health checks, restarts and start-up timeout."""
    return dataclasses.replace(
        FleetSettings.of_rollout(rollout),
        num_engines=model.num_engines,
        cpus_per_engine=model.cpus_per_engine,
        gpus_per_engine=model.gpus_per_engine,
        weights_from_disk=True,
        metrics_prefix=METRICS_PREFIX,
    )


class RewardFleet:
    """The reward servers of a run and who is told their URLs; see the module docstring."""

    def __init__(
        self,
        model: RewardModelConfig,
        rollout: RolloutConfig,
        *,
        on_servers: Callable[[Mapping[str, str]], None],
        dtype: str = "float32",
        api_key: str | None = None,
        expose_on_node_ip: bool = False,
        resource_name: str | None = None,
        log_dir: str | None = None,
        actor_factory: Callable[[EngineSpec], object] | None = None,
        health_probe: HealthProbe | None = None,
    ) -> None:
        self.membership = Membership(suspect_cooldown_s=rollout.suspect_cooldown_s)
        self._on_servers = on_servers
        options = {
            "dtype": dtype,
            "api_key": api_key,
            "expose_on_node_ip": expose_on_node_ip,
            "log_dir": log_dir,
        }
        self.fleet = EngineFleet.of_specs(
            reward_server_specs(model, rollout, **options),  # type: ignore[arg-type]
            reward_fleet_settings(model, rollout),
            membership=self.membership,
            api_key=api_key,
            resource_name=resource_name,
            weights_pushed=False,  # reward servers never take weight updates
            actor_factory=actor_factory,
            health_probe=health_probe,
            spec_factory=lambda name: reward_server_spec(model, rollout, name, **options),  # type: ignore[arg-type]
            name_prefix=NAME_PREFIX,
        )
        self.membership.subscribe(self._changed)

    def servers(self) -> dict[str, str]:
        """The servers a batch may go to now: name -> base URL."""
        urls = self.membership.urls()
        return {
            name: urls[name]
            for name in self.membership.names()
            if name in urls and self.membership.status(name) in SERVING
        }

    def _changed(self, event: MembershipEvent) -> None:
        self._on_servers(self.servers())

    async def start(self) -> dict[str, str]:
        """Start every server (raises naming the one that failed); the serving URLs."""
        await self.fleet.start()
        servers = self.servers()
        log.info("reward fleet serving: %s", servers)
        return servers

    async def run_health_checks(self) -> None:
        await self.fleet.run_health_checks()

    async def check_once(self) -> None:
        await self.fleet.check_once()

    async def wait_replacements(self) -> None:
        await self.fleet.wait_replacements()

    def metrics(self) -> dict[str, float]:
        return self.fleet.metrics()

    async def stop(self) -> None:
        self.membership.unsubscribe(self._changed)
        await self.fleet.stop()
