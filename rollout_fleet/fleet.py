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
``reward_fleet/*`` metrics). Left out: elastic scale-up/down at runtime (the membership
supports drain and remove; the fleet keeps N).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.actors import EngineSpec, create_engine_actor, engine_spec
from rollout_fleet.config import RolloutConfig
from rollout_fleet.engine_api import rollout_client_class
from rollout_fleet.engine_kinds import engine_kind
from rollout_fleet.membership import SERVING, EngineStatus, Membership, UnknownEngineError

log = get_logger(__name__)

_STOP_TIMEOUT_S = 30.0

HealthProbe = Callable[[str], Awaitable[bool]]


@dataclass
class _Slot:
    name: str
    spec: EngineSpec
    actor: Any = None
    failures: int = 0
    restarts: int = 0
    replacing: asyncio.Task[None] | None = None
    given_up: bool = False


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
        specs = [
            engine_spec(
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
                colocated=config.is_colocated_slot(index),
            )
            for index, name in ((i, f"{name_prefix}-{i}") for i in range(config.num_engines))
        ]
        self._setup(
            specs,
            FleetSettings.of_rollout(config),
            membership=membership,
            api_key=api_key,
            resource_name=resource_name,
            weights_pushed=weights_pushed,
            health_probe=health_probe,
            actor_factory=actor_factory,
        )

    @classmethod
    def of_specs(
        cls, specs: list[EngineSpec], settings: FleetSettings, **options: Any
    ) -> EngineFleet:
        """A fleet of one engine per spec (their names are the slots); ``options`` are the
        constructor's ``membership``, ``api_key``, ``resource_name``, ``weights_pushed``,
        ``health_probe`` and ``actor_factory``."""
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
        self._slots = {spec.name: _Slot(spec.name, spec) for spec in specs}
        self._client_class = rollout_client_class(specs[0].backend if specs else "embedded")
        self._health_clients: dict[str, Any] = {}
        self._stopping = False
        self.health_failures = 0
        self.engine_restarts = 0

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
        for slot, url in zip(self._slots.values(), results, strict=True):
            self.membership.launch(slot.name, url)
            if self.weights_from_disk and not self.weights_pushed:
                self.membership.weights_loaded(slot.name, 0)
        return self.urls()

    async def stop(self) -> None:
        """Stop health checks, replacements and every engine."""
        self._stopping = True
        for slot in self._slots.values():
            if slot.replacing is not None:
                slot.replacing.cancel()
        await asyncio.gather(*(self._kill(slot) for slot in self._slots.values()))
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
            f"{p}/engines_alive": float(sum(s in SERVING for s in states)),
            f"{p}/engines_starting": float(sum(s is EngineStatus.STARTING for s in states)),
            f"{p}/engines_needing_weights": float(
                sum(s is EngineStatus.NEEDS_WEIGHTS for s in states)
            ),
            f"{p}/engines_dead": float(sum(s is EngineStatus.DEAD for s in states)),
            f"{p}/engines_released": float(sum(s is EngineStatus.RELEASED for s in states)),
            f"{p}/engine_restarts": float(self.engine_restarts),
            f"{p}/health_failures": float(self.health_failures),
        }

    # ---- health ---------------------------------------------------------------------------

    async def run_health_checks(self) -> None:
        """Check every engine each ``health_check_interval_s`` until ``stop()``."""
        while not self._stopping:
            await self.check_once()
            await asyncio.sleep(self.settings.health_check_interval_s)

    async def check_once(self) -> None:
        """One round of health checks over all slots (replacements run in the background)."""
        slots = [s for s in self._slots.values() if s.replacing is None and not s.given_up]
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
                url = await self._launch(slot)
            except Exception as err:  # noqa: BLE001 - any start failure: count it, retry next round
                log.error("engine %s failed to restart: %r", slot.name, err)
                await self._kill(slot)
                return
            slot.failures = 0
            self.membership.launch(slot.name, url)
            if self.weights_pushed:  # the next publish (the driver's rejoin) makes it READY
                version = self.membership.latest_version
                self.membership.require_weights(slot.name, version, "replacement")
            else:  # nobody pushes weights: it serves those it loaded from disk
                self.membership.weights_loaded(slot.name, 0)
        finally:
            slot.replacing = None

    async def _launch(self, slot: _Slot) -> str:
        """Create and start the slot's actor; the engine's URL."""
        slot.actor = self._actor_factory(slot.spec)
        return await asyncio.wait_for(
            _awaitable(slot.actor.start.remote()), self.settings.engine_startup_timeout_s
        )

    async def _kill(self, slot: _Slot) -> None:
        actor, slot.actor = slot.actor, None
        if actor is None:
            return
        try:
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
