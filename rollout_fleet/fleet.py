"""The engine fleet: start N engine actors, watch their health, replace the dead ones.

The fleet owns the engine *processes* (actor handles, restart budgets); whether an
engine may take requests is the ``Membership``'s (rollout_fleet/membership.py),
which the fleet drives. Lifecycle of one engine slot (``engine-0`` ... ``engine-{N-1}``)::

    create actor -> start (URL) -> membership.launch            (STARTING)
        -> health checks every health_check_interval_s:
             actor ping (Ray) and GET /health (HTTP, with a timeout)
             one failure of a serving engine: membership.suspect (routed to last)
             N failures or the actor died: membership.die (the worker regenerates
                 its requests in flight elsewhere), kill the actor, start a new one
             a RELEASED engine (co-located, paused for the learner's step) is only
                 pinged: its process must live, its HTTP probe would wait for the step
        -> replacement: membership.launch (a new incarnation), then
             weights_pushed: membership.require_weights(latest version) - the next
                 publish (the driver's rejoin) sends it the weights, which makes it READY
             else: it serves the weights it loaded from disk (READY at version 0)

Without weight sync (``weights_pushed=False``) engines whose first weights come
from disk (embedded engine; SGLang with ``load_format=auto``) start READY; under
weight sync every engine waits at STARTING for the first publish. A slot that
used up ``max_engine_restarts`` stays DEAD; the run goes on with the others
(``fleet/engines_alive`` says how many).

All methods are coroutines on the caller's event loop (Ray object refs are
awaitable), so the health loop runs beside the rollout worker.

The same supervision serves any pool of engine actors: ``EngineFleet(rollout_config, ...)``
builds the rollout engines' specs from the rollout section, ``EngineFleet.of_specs(specs,
FleetSettings(...))`` takes them ready-made (the reward-model servers of
``rollout_fleet.rewards.fleet``, which never take weight pushes and report
``reward_fleet/*`` metrics).

Elastic fleets (``rollout_fleet.elastic`` decides when and where) grow and shrink through
three calls: ``place_engine(node)`` adds a slot whose actor is created on that node
(PLACING, then launched and brought up to date as a replacement is); ``remove_engine``
stops one and forgets it (a drained engine, a cancelled placement); ``lose_engine``
declares one dead at once and forgets it (its node left the cluster: its requests in flight
are regenerated elsewhere). Before replacing a dead engine in place the fleet asks
``on_engine_death`` (set by the elastic controller): an engine whose node left is lost,
not replaced on a node that is gone.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.actors import EngineSpec, create_engine_actor, engine_spec, node_strategy
from rollout_fleet.config import RolloutConfig
from rollout_fleet.engine_api import rollout_client_class
from rollout_fleet.engine_kinds import engine_kind
from rollout_fleet.membership import SERVING, EngineStatus, Membership, UnknownEngineError

log = get_logger(__name__)

_STOP_TIMEOUT_S = 30.0

HealthProbe = Callable[[str], Awaitable[bool]]
# (name, why it died) -> True when the death is handled (the engine is lost, not replaced)
DeathHandler = Callable[[str, str], Awaitable[bool]]


@dataclass
class _Slot:
    name: str
    spec: EngineSpec
    actor: Any = None
    failures: int = 0
    restarts: int = 0
    replacing: asyncio.Task[None] | None = None  # a replacement or (elastic) a placement
    given_up: bool = False
    node: str = ""  # elastic placement: the node its actor was created on


@dataclass(frozen=True)
class FleetSettings:
    """What supervising a fleet needs, whatever its engines serve (rollout or reward)."""

    num_engines: int
    cpus_per_engine: float
    gpus_per_engine: float
    health_check_interval_s: float
    health_check_timeout_s: float
    health_failures_before_dead: int
    max_engine_restarts: int
    engine_startup_timeout_s: float
    weights_from_disk: bool  # a fresh engine serves real (version 0) weights before any push
    metrics_prefix: str = "fleet"

    @classmethod
    def of_rollout(cls, config: RolloutConfig) -> FleetSettings:
        return cls(
            num_engines=config.num_engines,
            cpus_per_engine=config.cpus_per_engine,
            gpus_per_engine=config.gpus_per_engine,
            health_check_interval_s=config.health_check_interval_s,
            health_check_timeout_s=config.health_check_timeout_s,
            health_failures_before_dead=config.health_failures_before_dead,
            max_engine_restarts=config.max_engine_restarts,
            engine_startup_timeout_s=config.engine_startup_timeout_s,
            weights_from_disk=engine_kind(config.backend).load_format(config) == "auto",
        )


class EngineFleet:
    """N engine actors, health-checked and replaced; see the module docstring.

    ``EngineFleet(rollout_config, model_path, ...)`` is the rollout fleet;
    ``EngineFleet.of_specs(specs, settings, ...)`` any other (the reward servers).
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_path: str,
        *,
        membership: Membership,
        device: str = "cpu",
        dtype: str = "float32",
        api_key: str | None = None,
        expose_on_node_ip: bool = False,
        resource_name: str | None = None,
        weights_pushed: bool = False,
        health_probe: HealthProbe | None = None,
        actor_factory: Callable[[EngineSpec], Any] | None = None,
        name_prefix: str = "engine",
        log_dir: str | None = None,
        pause_mode: str = "in_place",
        lora_rank: int = 0,
        lora_target_modules: list[str] | None = None,
    ):
        def spec_of(name: str, index: int = -1) -> EngineSpec:
            return engine_spec(
                config,
                name,
                model_path,
                device=device,
                dtype=dtype,
                api_key=api_key,
                expose_on_node_ip=expose_on_node_ip,
                log_dir=log_dir,
                pause_mode=pause_mode,
                lora_rank=lora_rank,
                lora_target_modules=lora_target_modules,
                colocated=index >= 0 and config.is_colocated_slot(index),
            )

        self._setup(
            [spec_of(f"{name_prefix}-{i}", i) for i in range(config.num_engines)],
            FleetSettings.of_rollout(config),
            membership=membership,
            api_key=api_key,
            resource_name=resource_name,
            weights_pushed=weights_pushed,
            health_probe=health_probe,
            actor_factory=actor_factory,
            spec_factory=spec_of,  # engines an elastic fleet adds (never co-located)
            name_prefix=name_prefix,
        )

    @classmethod
    def of_specs(
        cls, specs: list[EngineSpec], settings: FleetSettings, **options: Any
    ) -> EngineFleet:
        """A fleet of one engine per spec (their names are the slots); ``options`` are the
        constructor's ``membership``, ``api_key``, ``resource_name``, ``weights_pushed``,
        ``health_probe`` and ``actor_factory``, and ``spec_factory`` (name -> spec: how
        ``place_engine`` makes the spec of an engine it adds) with ``name_prefix``."""
        fleet = cls.__new__(cls)
        fleet._setup(specs, settings, **options)
        return fleet

    def _setup(
        self,
        specs: list[EngineSpec],
        settings: FleetSettings,
        *,
        membership: Membership,
        api_key: str | None = None,
        resource_name: str | None = None,
        weights_pushed: bool = False,
        health_probe: HealthProbe | None = None,
        actor_factory: Callable[[EngineSpec], Any] | None = None,
        spec_factory: Callable[[str], EngineSpec] | None = None,
        name_prefix: str = "engine",
        node_actor_factory: Callable[[EngineSpec, str], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.membership = membership
        self.api_key = api_key
        self.weights_pushed = weights_pushed  # weight sync brings new engines up to date
        self._probe = health_probe or self._http_health
        self._actor_factory = actor_factory or (
            lambda spec: create_engine_actor(
                spec,
                num_cpus=settings.cpus_per_engine,
                num_gpus=settings.gpus_per_engine,
                resource_name=resource_name,
            )
        )
        # an engine placed on a chosen node (elastic): the same actor, pinned to that node
        self._node_actor_factory = node_actor_factory or (
            lambda spec, node: create_engine_actor(
                spec,
                num_cpus=settings.cpus_per_engine,
                num_gpus=settings.gpus_per_engine,
                resource_name=resource_name,
                scheduling_strategy=node_strategy(node),
            )
        )
        self._spec_factory = spec_factory
        self._name_prefix = name_prefix
        self._slots = {spec.name: _Slot(spec.name, spec) for spec in specs}
        self._client_class = rollout_client_class(specs[0].backend if specs else "embedded")
        self._health_clients: dict[str, Any] = {}
        self._stopping = False
        self.on_engine_death: DeathHandler | None = None  # set by an elastic controller
        self.health_failures = 0
        self.engine_restarts = 0
        self.placement_failures = 0

    @property
    def weights_from_disk(self) -> bool:
        """Whether a fresh engine serves real (version 0) weights before any broadcast."""
        return self.settings.weights_from_disk

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        """Start every engine (in parallel); launch them in the membership; name -> URL."""
        results = await asyncio.gather(
            *(self._launch(slot) for slot in self._slots.values()), return_exceptions=True
        )
        errors = [
            (s.name, r)
            for s, r in zip(self._slots.values(), results, strict=True)
            if isinstance(r, BaseException)
        ]
        if errors:
            await self.stop()
            name, err = errors[0]
            raise RuntimeError(f"engine {name} failed to start: {err!r}") from err
        for slot, (url, node) in zip(self._slots.values(), results, strict=True):
            self.membership.launch(slot.name, url, node=node)
            if self.weights_from_disk and not self.weights_pushed:
                self.membership.weights_loaded(slot.name, 0)
        return self.urls()

    async def stop(self) -> None:
        """Stop health checks, replacements and every engine."""
        self._stopping = True
        for slot in self._slots.values():
            if slot.replacing is not None:
                slot.replacing.cancel()
        await asyncio.gather(*(self._kill(slot) for slot in list(self._slots.values())))
        for client in self._health_clients.values():
            close = getattr(client, "close", None)
            if close is not None and inspect.iscoroutinefunction(close):
                await close()
        self._health_clients.clear()

    def slot_names(self) -> list[str]:
        """The engine slots, in order (``engine-0`` first)."""
        return list(self._slots)

    def urls(self) -> dict[str, str]:
        """URL of every engine process running now."""
        urls = self.membership.urls()
        return {name: urls[name] for name in self._slots if name in urls}

    def metrics(self) -> dict[str, float]:
        states = [self._state(name) for name in self._slots]
        p = self.settings.metrics_prefix
        return {
            f"{p}/engines": float(sum(s in SERVING for s in states)),  # routable
            f"{p}/engines_alive": float(sum(s in SERVING for s in states)),
            f"{p}/engines_placing": float(sum(s is EngineStatus.PLACING for s in states)),
            f"{p}/engines_draining": float(sum(s is EngineStatus.DRAINING for s in states)),
            f"{p}/engines_starting": float(sum(s is EngineStatus.STARTING for s in states)),
            f"{p}/engines_needing_weights": float(
                sum(s is EngineStatus.NEEDS_WEIGHTS for s in states)
            ),
            f"{p}/engines_dead": float(sum(s is EngineStatus.DEAD for s in states)),
            f"{p}/engines_released": float(sum(s is EngineStatus.RELEASED for s in states)),
            f"{p}/engine_restarts": float(self.engine_restarts),
            f"{p}/health_failures": float(self.health_failures),
            f"{p}/placement_failures": float(self.placement_failures),
        }

    # ---- health ---------------------------------------------------------------------------

    async def run_health_checks(self) -> None:
        """Check every engine each ``health_check_interval_s`` until ``stop()``."""
        while not self._stopping:
            await self.check_once()
            await asyncio.sleep(self.settings.health_check_interval_s)

    async def check_once(self) -> None:
        """One round of health checks over all slots (replacements run in the background;
        a draining engine is leaving and never replaced)."""
        slots = [
            s
            for s in self._slots.values()
            if s.replacing is None
            and not s.given_up
            and self._state(s.name) is not EngineStatus.DRAINING
        ]
        await asyncio.gather(*(self._check(slot) for slot in slots))

    async def wait_replacements(self) -> None:
        """Wait until no replacement is in progress (tests, orderly shutdown)."""
        pending = [s.replacing for s in self._slots.values() if s.replacing is not None]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _check(self, slot: _Slot) -> None:
        if slot.actor is None:
            self._replace(slot, "no running actor")
            return
        reason, fatal = await self._failure_reason(slot)
        if reason is None:
            slot.failures = 0
            return
        self.health_failures += 1
        slot.failures += 1
        if fatal or slot.failures >= self.settings.health_failures_before_dead:
            if self.on_engine_death is not None and await self.on_engine_death(slot.name, reason):
                return  # lost with its node (the elastic controller forgot it)
            self._replace(slot, reason)
        else:
            log.warning(
                "engine %s failed a health check (%d): %s", slot.name, slot.failures, reason
            )
            if self._state(slot.name) in SERVING:
                self.membership.suspect(slot.name, reason)

    async def _failure_reason(self, slot: _Slot) -> tuple[str | None, bool]:
        """(why the engine looks unhealthy, whether that is certainly fatal); (None, False) if fine."""
        timeout = self.settings.health_check_timeout_s
        try:
            info = await asyncio.wait_for(_awaitable(slot.actor.ping.remote()), timeout)
        except TimeoutError:
            return f"actor ping timed out after {timeout} s", False
        except Exception as err:  # noqa: BLE001 - Ray raises many error types for a dead actor
            return f"actor died: {type(err).__name__}: {err}", True
        if not info.get("alive", True):
            return "the actor reports its engine process exited", True
        if self._state(slot.name) is EngineStatus.RELEASED:
            # paused for the learner's step on purpose: an HTTP probe (SGLang's /health
            # generates a token) would wait for the step; the live process is the check
            return None, False
        try:
            healthy = await asyncio.wait_for(self._probe(self.membership.url(slot.name)), timeout)
        except TimeoutError:
            return f"GET /health timed out after {timeout} s", False
        return (None, False) if healthy else ("GET /health failed", False)

    async def _http_health(self, url: str) -> bool:
        client = self._health_clients.get(url)
        if client is None:
            client = self._health_clients[url] = self._client_class(
                url, api_key=self.api_key, timeout_s=self.settings.health_check_timeout_s, retries=0
            )
        return bool(await client.health())

    # ---- replacement ----------------------------------------------------------------------

    def _replace(self, slot: _Slot, reason: str) -> None:
        if self._stopping or slot.replacing is not None:
            return
        if self._state(slot.name) not in (EngineStatus.DEAD, None):
            self.membership.die(slot.name, reason)
        slot.replacing = asyncio.ensure_future(self._replace_now(slot, reason))

    async def _replace_now(self, slot: _Slot, reason: str) -> None:
        try:
            await self._kill(slot)
            if slot.restarts >= self.settings.max_engine_restarts:
                slot.given_up = True
                log.error(
                    "engine %s is dead (%s) and its %d restarts are spent; continuing without it",
                    slot.name,
                    reason,
                    self.settings.max_engine_restarts,
                )
                return
            slot.restarts += 1
            self.engine_restarts += 1
            log.warning("replacing engine %s (restart %d): %s", slot.name, slot.restarts, reason)
            try:
                url, node = await self._launch(slot)
            except Exception as err:  # noqa: BLE001 - any start failure: count it, retry next round
                log.error("engine %s failed to restart: %r", slot.name, err)
                await self._kill(slot)
                return
            slot.failures = 0
            self.membership.launch(slot.name, url, node=node)
            self._serve_or_wait(slot.name, "replacement")
        finally:
            slot.replacing = None

    def _serve_or_wait(self, name: str, why: str) -> None:
        """A new process of ``name`` launched: under weight sync it waits for the current
        version (the driver's rejoin sends it), else it serves the weights it loaded."""
        if self.weights_pushed:
            self.membership.require_weights(name, self.membership.latest_version, why)
        else:
            self.membership.weights_loaded(name, 0)

    async def _launch(self, slot: _Slot) -> tuple[str, str]:
        """Create and start the slot's actor (on ``slot.node`` when one was chosen); the
        engine's URL and the Ray node it runs on ("" when the actor does not say)."""
        if slot.node:
            slot.actor = self._node_actor_factory(slot.spec, slot.node)
        else:
            slot.actor = self._actor_factory(slot.spec)
        timeout = self.settings.engine_startup_timeout_s
        url = await asyncio.wait_for(_awaitable(slot.actor.start.remote()), timeout)
        info = await asyncio.wait_for(_awaitable(slot.actor.ping.remote()), timeout)
        return url, str(info.get("node", "") or slot.node)

    # ---- elastic: engines added and removed while the run trains ---------------------------

    def place_engine(self, node: str = "") -> str:
        """Add an engine slot, its actor created on Ray node ``node`` (any rollout node when
        ""): PLACING until it starts, then brought up to date as a replacement is. Its name."""
        if self._spec_factory is None:
            raise RuntimeError("this fleet has no spec factory: it cannot add engines")
        index = 0
        while f"{self._name_prefix}-{index}" in self._slots:
            index += 1
        name = f"{self._name_prefix}-{index}"
        slot = _Slot(name, self._spec_factory(name), node=node)
        self._slots[name] = slot
        self.membership.place(name, node)
        slot.replacing = asyncio.ensure_future(self._join(slot))
        return name

    async def _join(self, slot: _Slot) -> None:
        started = time.monotonic()
        try:
            url, node = await self._launch(slot)
        except Exception as err:  # noqa: BLE001 - any placement or start failure: forget the slot
            self.placement_failures += 1
            log.error("engine %s could not be placed or started: %r", slot.name, err)
            slot.replacing = None
            await self.remove_engine(slot.name, f"placement failed: {err!r}", graceful=False)
            return
        slot.replacing = None
        if self._slots.get(slot.name) is not slot or self._state(slot.name) is not EngineStatus.PLACING:  # fmt: skip
            return  # removed or drained while it started: remove_engine stops it
        self.membership.launch(slot.name, url, node=node)
        log.info("engine %s started on node %s in %.1f s", slot.name, node[:12], time.monotonic() - started)  # fmt: skip
        self._serve_or_wait(slot.name, "joined the fleet")

    async def remove_engine(self, name: str, reason: str, *, graceful: bool = True) -> None:
        """Stop engine ``name`` (a drained one, or a placement no longer wanted), release its
        actor's resources and forget it."""
        slot = self._slots.pop(name, None)
        if slot is None:
            return
        if slot.replacing is not None:
            slot.replacing.cancel()
            await asyncio.gather(slot.replacing, return_exceptions=True)
        self._forget(name, reason)
        await self._kill(slot, graceful=graceful and slot.actor is not None)

    def lose_engine(self, name: str, reason: str) -> None:
        """Engine ``name`` is gone with its node: dead at once (its requests in flight are
        regenerated elsewhere), forgotten, its actor killed in the background."""
        slot = self._slots.pop(name, None)
        self._forget(name, reason)
        if slot is not None:
            if slot.replacing is not None:
                slot.replacing.cancel()
            asyncio.ensure_future(self._kill(slot, graceful=False))

    def _forget(self, name: str, reason: str) -> None:
        state = self._state(name)
        if state is not None:  # its health client's HTTP session goes with it
            client = self._health_clients.pop(self.membership.url(name), None)
            close = getattr(client, "close", None)
            if close is not None and inspect.iscoroutinefunction(close):
                asyncio.ensure_future(close())
        if state not in (EngineStatus.DEAD, None):
            self.membership.die(name, reason)
        if state is not None:
            self.membership.remove(name)

    def engine_names(self, statuses: frozenset[EngineStatus] | None = None) -> list[str]:
        """This fleet's engines (in ``statuses``, when given)."""
        return [n for n in self._slots if statuses is None or self._state(n) in statuses]

    async def _kill(self, slot: _Slot, *, graceful: bool = True) -> None:
        """Stop the slot's engine (``graceful``: ask the actor first) and kill its actor."""
        actor, slot.actor = slot.actor, None
        if actor is None:
            return
        try:
            if graceful:
                await asyncio.wait_for(_awaitable(actor.stop.remote()), _STOP_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - a dead actor cannot stop its engine: expected
            log.info("engine %s: stop() did not complete (%s); killing its actor", slot.name, err)
        kill = getattr(actor, "kill", None)
        if kill is not None:  # fakes in tests
            kill()
        else:
            import ray

            ray.kill(actor, no_restart=True)

    def _state(self, name: str) -> EngineStatus | None:
        try:
            return self.membership.status(name)
        except UnknownEngineError:
            return None


def _awaitable(ref: Any) -> Awaitable[Any]:
    """A Ray ObjectRef (or a test fake's awaitable) as something asyncio can wait for."""
    if inspect.isawaitable(ref):
        return ref
    raise TypeError(f"expected an awaitable object ref, got {type(ref).__name__}")
