"""The rollout role's part of fleet scaling: its elastic controllers and the control endpoint.

``RolloutScaling`` lives in the rollout role (launcher/rollout_role.py) beside the fleets it
steers. With ``rollout.elastic`` it holds one ``rollout_fleet.elastic.ElasticFleet`` for the
rollout engines (drained engines' requests finish or are aborted as ``weight_sync.pause_mode``
says; their load is the router's requests outstanding) and one for the reward servers the
run places (their load is the reward client's batches in flight; a batch cut short by a stop
fails over to another server). For every run it serves the fleet control endpoint
(launcher/fleet_control.py): ``status`` for any fleet, ``scale`` for an elastic one.

Calls come from the control thread and are answered on the role's event loop
(``answer_threadsafe``), where the fleets live, so no fleet state is touched from two
threads.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetrl.log import get_logger
from launcher.config import RunConfig
from launcher.fleet_control import (
    ControlReply,
    ControlRequest,
    ControlServer,
    EngineRow,
    ErrorReply,
    FleetState,
    ScaleReply,
    ScaleRequest,
    StatusReply,
)
from rollout_fleet.actors import NODE_MARKER_SHARE
from rollout_fleet.elastic import ElasticFleet, ElasticSettings, ScaleRefused, engine_bundle
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import SERVING, MembershipError

log = get_logger(__name__)

ANSWER_TIMEOUT_S = 20.0


def fleet_settings(cfg: RunConfig, fleet: str) -> ElasticSettings:
    """The elastic settings of the ``rollout`` fleet or the ``reward`` fleet of a run: each
    its own range, resources and node marker; the rollout section's timing for both. A
    rollout engine leaving aborts at once unless engines pause in place; a reward server's
    batches always finish (they are short)."""
    rollout = cfg.rollout
    section, key, marker = (
        (rollout, "rollout", cfg.ray.rollout_resource)
        if fleet == "rollout"
        else (cfg.reward.model, "reward.model", cfg.ray.reward_resource)
    )
    low, high = section.engine_range
    bundle = engine_bundle(section.cpus_per_engine, section.gpus_per_engine, marker, NODE_MARKER_SHARE)  # fmt: skip
    return ElasticSettings(
        fleet=fleet,
        key=key,
        start=section.num_engines,
        min_engines=low,
        max_engines=high,
        bundle=bundle,
        marker=marker,
        check_interval_s=rollout.placement_check_interval_s,
        wait_bound_s=cfg.ray.placement_timeout_s,
        drain_timeout_s=rollout.drain_timeout_s,
        abort_on_drain=fleet == "rollout" and cfg.weight_sync.pause_mode != "in_place",
        ask_autoscaler=cfg.ray.autoscaling,
        metrics_prefix="fleet" if fleet == "rollout" else "reward_fleet",
    )


class RolloutScaling:
    """Elastic controllers of one rollout role and its control endpoint; see the module doc."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        fleet: EngineFleet,
        router: Any,
        reward_servers: Any,
        api_key: str | None,
        cluster: Any = None,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.router = router
        self.reward_servers = reward_servers
        self.api_key = api_key
        self.rollout: ElasticFleet | None = None
        self.reward: ElasticFleet | None = None
        if cfg.rollout.elastic:
            from rollout_fleet.cluster import RayCluster

            cluster = cluster or RayCluster()
            self.rollout = ElasticFleet(
                fleet,
                fleet_settings(cfg, "rollout"),
                cluster,
                in_flight=self._requests_on,
                abort=self._abort_requests,
            )
            if self._reward_fleet() is not None:
                self.reward = ElasticFleet(
                    self._reward_fleet(),
                    fleet_settings(cfg, "reward"),
                    cluster,
                    in_flight=reward_servers.client.in_flight,
                )
        self._tasks: list[asyncio.Task[None]] = []
        self._server: ControlServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the version the engines hold: the newest any publish delivered
        self.policy_version = lambda: fleet.membership.latest_version

    def _reward_fleet(self) -> EngineFleet | None:
        placed = self.reward_servers.fleet if self.reward_servers is not None else None
        return placed.fleet if placed is not None else None

    def _elastic(self) -> list[ElasticFleet]:
        return [f for f in (self.rollout, self.reward) if f is not None]

    # ---- lifecycle ---------------------------------------------------------------------

    def serve(self, keys: Any, host: str) -> str:
        """Start the control endpoint (on the role's event loop's thread); its address."""
        self._loop = asyncio.get_running_loop()
        self._server = ControlServer(keys, host, self.answer_threadsafe)
        return self._server.start()

    def start(self) -> None:
        """Start following the cluster (after the first weights reached the engines)."""
        for elastic in self._elastic():
            elastic.attach()
            self._tasks.append(asyncio.create_task(elastic.run()))

    async def stop(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for elastic in self._elastic():
            await elastic.stop()

    def failure(self) -> str:
        """Why the run must stop ("" when nothing is wrong): a fleet below its minimum."""
        return "; ".join(e.failure for e in self._elastic() if e.failure)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for elastic in self._elastic():
            out.update(elastic.metrics())
        return out

    def serving_share(self) -> float:
        """Rollout engines serving now, as a share of the start size (admission's cap)."""
        return self.fleet.membership.count(SERVING) / max(1, self.cfg.rollout.num_engines)

    # ---- requests ----------------------------------------------------------------------

    def answer_threadsafe(self, request: ControlRequest) -> ControlReply:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self.answer(request), self._loop)
        return future.result(ANSWER_TIMEOUT_S)

    async def answer(self, request: ControlRequest) -> ControlReply:
        if isinstance(request, ScaleRequest):
            return self._scale(request)
        fleets = [self._state("rollout", self.fleet, self.rollout, self._requests_on)]
        reward = self._reward_fleet()
        if reward is not None:
            fleets.append(
                self._state("reward", reward, self.reward, self.reward_servers.client.in_flight)
            )
        return StatusReply(policy_version=int(self.policy_version()), fleets=fleets)

    def _scale(self, request: ScaleRequest) -> ControlReply:
        elastic = {"rollout": self.rollout, "reward": self.reward}.get(request.fleet)
        if request.fleet == "reward" and self._reward_fleet() is None:
            return ErrorReply(message="this run places no reward fleet (reward.model.path, no urls)")  # fmt: skip
        if elastic is None:
            return ErrorReply(
                message=f"the {request.fleet} fleet is not elastic (rollout.elastic=false): its "
                "size is fixed for the run; start it with rollout.elastic=true and a range"
            )
        try:
            previous, target = elastic.set_target(request.engines)
        except ScaleRefused as err:
            return ErrorReply(message=str(err))
        return ScaleReply(
            fleet=request.fleet,
            previous=previous,
            target=target,
            min_engines=elastic.settings.min_engines,
            max_engines=elastic.settings.max_engines,
            serving=elastic.serving(),
        )

    def _state(
        self, name: str, fleet: EngineFleet, elastic: ElasticFleet | None, in_flight: Any
    ) -> FleetState:
        snapshot = self.router.snapshot() if name == "rollout" else fleet.membership.snapshot()
        rows = [
            EngineRow(
                name=engine,
                state=str(row["state"]),
                node=str(row.get("node") or ""),
                version=row.get("version"),  # type: ignore[arg-type]
                needs_version=row.get("needs_version"),  # type: ignore[arg-type]
                in_flight=int(in_flight(engine)),
                groups=int(row.get("groups", 0)),  # type: ignore[arg-type]
                # why it is not serving (a serving engine's last reason is history)
                reason="" if row["state"] == "ready" else str(row.get("reason") or ""),
            )
            for engine, row in sorted(snapshot.items())
        ]
        count = len(fleet.engine_names())
        return FleetState(
            fleet=name,
            elastic=elastic is not None,
            target=elastic.target if elastic is not None else count,
            min_engines=elastic.settings.min_engines if elastic is not None else count,
            max_engines=elastic.settings.max_engines if elastic is not None else count,
            serving=fleet.membership.count(SERVING),
            engines=rows,
            joins=elastic.joins if elastic is not None else 0,
            leaves=elastic.leaves if elastic is not None else 0,
            lost=elastic.lost if elastic is not None else 0,
        )

    # ---- a leaving rollout engine --------------------------------------------------------

    def _requests_on(self, name: str) -> int:
        try:
            return self.router.outstanding(name)
        except MembershipError:
            return 0

    async def _abort_requests(self, name: str) -> None:
        """Every request on ``name`` returns now with its tokens so far (SGLang's abort
        pause); the sample runner resubmits each elsewhere."""
        from rollout_fleet.engine_api import rollout_client_class

        url = self.fleet.membership.urls().get(name)
        if not url:
            return
        client_class = rollout_client_class(self.cfg.rollout.backend)
        client = client_class(url, api_key=self.api_key, timeout_s=10.0, retries=0)
        try:
            await client.pause_generation("abort")
        finally:
            await client.close()
