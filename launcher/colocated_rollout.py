"""The rollout role's part of a co-located run (``rollout.placement: colocated``).

``RolloutColocation`` is what ``launcher.rollout_role.RolloutRole`` holds in a co-located run:

- placement: engine slot i < ``rollout.colocated_engines`` is created in bundle i of the
  learner's placement group (``launcher.placement.colocated_engine_options``); a mixed
  run's remote engines go on rollout nodes as usual;
- the map from an engine to the learner rank on its device (``device_rank``; -1 remote),
  which tags each publish's targets (``EngineTarget.device_rank``: who pushes to whom);
- the ``rollout_fleet.colocation.ColocatedEngines`` owner (pause, release, resume), with
  the HTTP clients its calls use (one per engine process, by URL).

Targets (``ready_to_receive``): before a publish the released co-located engines get
their weight memory back, and one that could not is left out of the publish (and of
routing, until a later publish resumes it); a rejoin (the current version again) leaves
out co-located engines that serve it already (a push by handle needs no group, so only the engines
behind get it; remote engines are all in the broadcast group and all get it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from launcher.config import RunConfig
from rollout_fleet.membership import SERVING, Membership, SyncOutcome, WeightTargets


class RolloutColocation:
    """Engine placement, device ranks and the co-location owner of one rollout role."""

    def __init__(
        self,
        cfg: RunConfig,
        membership: Membership,
        slot_names: Callable[[], list[str]],
        api_key: str | None,
    ) -> None:
        from rollout_fleet.colocation import ColocatedEngines

        self.cfg = cfg
        self.membership = membership
        self._slot_names = slot_names  # the fleet's engine slots, in order
        self.api_key = api_key
        self._clients: dict[str, Any] = {}  # url -> rollout_fleet.client.EngineClient
        self.engines = ColocatedEngines(
            cfg.rollout.colocate,
            membership,
            client_for=self._client,
            colocated=lambda name: self.device_rank(name) >= 0,
        )

    def actor_factory(self, placement_group: Any) -> Callable[[Any], Any]:
        """Creates engine actors: co-located slots in the learner's bundles, others as usual."""
        from launcher.placement import colocated_engine_options
        from rollout_fleet.actors import create_engine_actor

        rollout = self.cfg.rollout

        def create(spec: Any) -> Any:
            index = self._slot_names().index(spec.name)
            if rollout.is_colocated_slot(index):
                options = colocated_engine_options(self.cfg, placement_group, index)
            else:
                options = {
                    "num_cpus": rollout.cpus_per_engine,
                    "num_gpus": rollout.gpus_per_engine,
                    "resource_name": self.cfg.ray.rollout_resource,
                }
            return create_engine_actor(spec, **options)

        return create

    def device_rank(self, name: str) -> int:
        """The learner rank whose device engine ``name`` shares; -1 for a remote engine."""
        index = self._slot_names().index(name)
        return index if self.cfg.rollout.is_colocated_slot(index) else -1

    def _client(self, name: str) -> Any:
        from rollout_fleet.engine_api import rollout_client_class

        url = self.membership.url(name)
        if url not in self._clients:
            self._clients[url] = rollout_client_class(self.cfg.rollout.backend)(
                url, api_key=self.api_key, timeout_s=self.cfg.weight_sync.timeout_s, retries=0
            )
        return self._clients[url]

    async def ready_to_receive(self, targets: WeightTargets, *, rejoin: bool) -> WeightTargets:
        """``targets`` tagged with their device ranks, the released ones resumed (weights)."""
        tagged = [
            msgspec.structs.replace(t, device_rank=self.device_rank(t.name))
            for t in targets.engines
        ]
        engines = [
            t
            for t in tagged
            if not (rejoin and t.device_rank >= 0 and self.membership.status(t.name) in SERVING)
        ]
        unmapped = await self.engines.prepare_push([t.name for t in engines if t.device_rank >= 0])
        return WeightTargets(engines=tuple(t for t in engines if t.name not in unmapped))

    async def yield_devices(self) -> int:
        return await self.engines.yield_devices()

    async def take_back(self, outcome: SyncOutcome) -> SyncOutcome:
        return await self.engines.take_back(outcome)

    def metrics(self) -> dict[str, float]:
        return self.engines.metrics()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
