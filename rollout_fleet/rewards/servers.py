"""The reward-model servers a rollout role scores on, and the client that reaches them.

``RewardServers.for_run(reward, rollout, ...)`` is None without ``reward.model``; else it
holds the ``RewardModelClient`` (``client``) over either

- ``reward.model.urls``: servers already running (SGLang ``--is-embedding`` or
  ``fleetrl engine --model RM_DIR``), named ``reward-url-0``...; their bearer key
  (``url_api_key``) is read by the driver from its environment variable
  ``reward.model.api_key_env``; or
- a ``RewardFleet`` it places for ``reward.model.path`` (the run's own key), which hands
  the client every serving URL as servers start, die and are replaced.

The rollout role's reward pipeline scores through ``client`` (rollout_fleet/rewards/
pipeline.py); the role calls ``start`` (beside the rollout fleet's start), runs ``watch`` as a
task beside its engines' health loop, reads ``metrics`` (the client's ``reward_model/*``
counters and the fleet's ``reward_fleet/*``) and calls ``stop``. Left out: switching between
URLs and a fleet during a run.
"""

from __future__ import annotations

import asyncio

from fleetrl.log import get_logger
from rollout_fleet.config import RolloutConfig
from rollout_fleet.rewards.config import RewardConfig
from rollout_fleet.rewards.fleet import RewardFleet
from rollout_fleet.rewards.model_client import RewardModelClient
from rollout_fleet.rewards.model_scorer import servers_from_urls

log = get_logger(__name__)

HEALTH_LOOP_RETRY_S = 1.0


class RewardServers:
    """The client and (when placed here) the fleet of one run's reward-model servers."""

    def __init__(self, client: RewardModelClient, fleet: RewardFleet | None = None) -> None:
        self.client = client
        self.fleet = fleet

    @classmethod
    def for_run(
        cls,
        reward: RewardConfig,
        rollout: RolloutConfig,
        *,
        api_key: str | None,
        url_api_key: str | None = None,
        dtype: str = "float32",
        expose_on_node_ip: bool = False,
        resource_name: str | None = None,
        log_dir: str | None = None,
    ) -> RewardServers | None:
        """The run's reward servers (None when no reward model scores); ``api_key`` is the
        run's own (a placed fleet's), ``url_api_key`` that of ``reward.model.urls``."""
        model = reward.model
        if not reward.uses_model:
            return None
        if not reward.places_fleet:
            servers = servers_from_urls(model.urls)
            return cls(RewardModelClient.from_config(model, servers, url_api_key))
        client = RewardModelClient.from_config(model, {}, api_key)  # the fleet fills it in
        fleet = RewardFleet(
            model,
            rollout,
            on_servers=client.set_servers,
            dtype=dtype,
            api_key=api_key,
            expose_on_node_ip=expose_on_node_ip,
            resource_name=resource_name,
            log_dir=log_dir,
        )
        return cls(client, fleet)

    async def start(self) -> dict[str, str]:
        """Start the fleet, if one is placed; the servers the client scores on."""
        if self.fleet is not None:
            await self.fleet.start()
        return self.client.servers

    async def watch(self) -> None:
        """The fleet's health checks until cancelled (nothing to watch for urls)."""
        while self.fleet is not None:
            try:
                await self.fleet.run_health_checks()
                return
            except (OSError, RuntimeError, ValueError) as err:
                log.error("reward server health check round failed: %r; retrying", err)
                await asyncio.sleep(HEALTH_LOOP_RETRY_S)

    def metrics(self) -> dict[str, float]:
        out = self.client.stats()
        if self.fleet is not None:
            out.update(self.fleet.metrics())
        return out

    async def stop(self) -> None:
        if self.fleet is not None:
            await self.fleet.stop()
        await self.client.aclose()
