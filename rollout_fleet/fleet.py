"""The engine fleet: start N engine actors, watch their health, replace the dead ones.

Lifecycle of one engine slot (``engine-0`` ... ``engine-{N-1}``)::

    create actor -> start (URL) -> router.add_engine(starting | ready)
        -> health checks every health_check_interval_s:
             actor ping (Ray) and GET /health (HTTP, with a timeout)
             one failure: router.mark_suspect      (no new groups)
             N failures or the actor died: router.mark_dead (the worker regenerates
                 its requests in flight elsewhere), kill the actor, start a new one
        -> replacement: router.add_engine(name, new_url, ready=False)
             -> on_engine_restarted(name, url): weight sync adds the engine to its
                group and pushes the current weights, then calls fleet.mark_ready(name)
                (or the hook returns True to mean "ready now")

Engines whose first weights come from disk (embedded engine; SGLang with
``load_format=auto``) start ``ready``. SGLang with ``load_format=dummy`` starts
``starting``: the launcher marks every engine ready after the first broadcast.
A slot that used up ``max_engine_restarts`` stays dead; the run goes on with
the others (``fleet/engines_alive`` says how many).

All methods are coroutines on the caller's event loop (Ray object refs are
awaitable), so the health loop runs beside the rollout worker. Left out:
elastic scale-up/down at runtime (the router supports it; the fleet keeps N).
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
from rollout_fleet.router import EngineState, Router

log = get_logger(__name__)

_STOP_TIMEOUT_S = 30.0

HealthProbe = Callable[[str], Awaitable[bool]]
RestartHook = Callable[[str, str], Any]  # (name, url) -> True if ready now; may be async


@dataclass
class _Slot:
    name: str
    spec: EngineSpec
    actor: Any = None
    url: str = ""
    failures: int = 0
    restarts: int = 0
    replacing: asyncio.Task[None] | None = None
    given_up: bool = False


class EngineFleet:
    """N engine actors, health-checked and replaced; see the module docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        model_path: str,
        *,
        router: Router,
        device: str = "cpu",
        dtype: str = "float32",
        api_key: str | None = None,
        expose_on_node_ip: bool = False,
        resource_name: str | None = None,
        on_engine_restarted: RestartHook | None = None,
        health_probe: HealthProbe | None = None,
        actor_factory: Callable[[EngineSpec], Any] | None = None,
        name_prefix: str = "engine",
        log_dir: str | None = None,
        pause_mode: str = "in_place",
        lora_rank: int = 0,
        lora_target_modules: list[str] | None = None,
    ):
        self.config = config
        self.router = router
        self.api_key = api_key
        self.on_engine_restarted = on_engine_restarted
        self._probe = health_probe or self._http_health
        self._actor_factory = actor_factory or (
            lambda spec: create_engine_actor(
                spec,
                num_cpus=config.cpus_per_engine,
                num_gpus=config.gpus_per_engine,
                resource_name=resource_name,
            )
        )
        self._slots = {
            name: _Slot(
                name,
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
                ),
            )
            for name in (f"{name_prefix}-{i}" for i in range(config.num_engines))
        }
        self._health_clients: dict[str, Any] = {}
        self._stopping = False
        self.health_failures = 0
        self.engine_restarts = 0

    @property
    def weights_from_disk(self) -> bool:
        """Whether a fresh engine serves real (version 0) weights before any broadcast."""
        return self.config.backend == "embedded" or self.config.sglang_load_format == "auto"

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        """Start every engine (in parallel); register them with the router; name -> URL."""
        results = await asyncio.gather(
            *(self._launch(slot) for slot in self._slots.values()), return_exceptions=True
        )
        errors = [(s.name, r) for s, r in zip(self._slots.values(), results, strict=True) if r]
        if errors:
            await self.stop()
            name, err = errors[0]
            raise RuntimeError(f"engine {name} failed to start: {err!r}") from err
        for slot in self._slots.values():
            self.router.add_engine(slot.name, slot.url, ready=self.weights_from_disk)
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

    def mark_ready(self, name: str) -> None:
        """Weights are loaded on ``name`` (called by weight sync after its first push)."""
        self.router.mark_ready(name)

    def urls(self) -> dict[str, str]:
        return {name: slot.url for name, slot in self._slots.items() if slot.url}

    def metrics(self) -> dict[str, float]:
        states = [self._state(name) for name in self._slots]
        return {
            "fleet/engines_alive": float(
                sum(s in (EngineState.READY, EngineState.SUSPECT) for s in states)
            ),
            "fleet/engines_starting": float(sum(s is EngineState.STARTING for s in states)),
            "fleet/engines_dead": float(sum(s is EngineState.DEAD for s in states)),
            "fleet/engine_restarts": float(self.engine_restarts),
            "fleet/health_failures": float(self.health_failures),
        }

    # ---- health ---------------------------------------------------------------------------

    async def run_health_checks(self) -> None:
        """Check every engine each ``health_check_interval_s`` until ``stop()``."""
        while not self._stopping:
            await self.check_once()
            await asyncio.sleep(self.config.health_check_interval_s)

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
        if fatal or slot.failures >= self.config.health_failures_before_dead:
            self._replace(slot, reason)
        else:
            log.warning(
                "engine %s failed a health check (%d): %s", slot.name, slot.failures, reason
            )
            self.router.mark_suspect(slot.name, reason)

    async def _failure_reason(self, slot: _Slot) -> tuple[str | None, bool]:
        """(why the engine looks unhealthy, whether that is certainly fatal); (None, False) if fine."""
        timeout = self.config.health_check_timeout_s
        try:
            info = await asyncio.wait_for(_awaitable(slot.actor.ping.remote()), timeout)
        except TimeoutError:
            return f"actor ping timed out after {timeout} s", False
        except Exception as err:  # noqa: BLE001 - Ray raises many error types for a dead actor
            return f"actor died: {type(err).__name__}: {err}", True
        if not info.get("alive", True):
            return "the actor reports its engine process exited", True
        try:
            healthy = await asyncio.wait_for(self._probe(slot.url), timeout)
        except TimeoutError:
            return f"GET /health timed out after {timeout} s", False
        return (None, False) if healthy else ("GET /health failed", False)

    async def _http_health(self, url: str) -> bool:
        from rollout_fleet.client import EngineClient

        client = self._health_clients.get(url)
        if client is None:
            client = self._health_clients[url] = EngineClient(
                url, api_key=self.api_key, timeout_s=self.config.health_check_timeout_s, retries=0
            )
        return bool(await client.health())

    # ---- replacement ----------------------------------------------------------------------

    def _replace(self, slot: _Slot, reason: str) -> None:
        if self._stopping or slot.replacing is not None:
            return
        if self._state(slot.name) not in (EngineState.DEAD, None):
            self.router.mark_dead(slot.name, reason)
        slot.replacing = asyncio.ensure_future(self._replace_now(slot, reason))

    async def _replace_now(self, slot: _Slot, reason: str) -> None:
        try:
            await self._kill(slot)
            if slot.restarts >= self.config.max_engine_restarts:
                slot.given_up = True
                log.error(
                    "engine %s is dead (%s) and its %d restarts are spent; continuing without it",
                    slot.name,
                    reason,
                    self.config.max_engine_restarts,
                )
                return
            slot.restarts += 1
            self.engine_restarts += 1
            log.warning("replacing engine %s (restart %d): %s", slot.name, slot.restarts, reason)
            try:
                await self._launch(slot)
            except Exception as err:  # noqa: BLE001 - any start failure: count it, retry next round
                log.error("engine %s failed to restart: %r", slot.name, err)
                await self._kill(slot)
                return
            slot.failures = 0
            self.router.add_engine(slot.name, slot.url, ready=False)
            await self._announce(slot)
        finally:
            slot.replacing = None

    async def _announce(self, slot: _Slot) -> None:
        """Tell the hook about the new engine; mark it ready when weights are in place."""
        if self.on_engine_restarted is None:
            # nobody pushes weights: it serves the disk weights, tagged with the version it reports
            self.router.mark_ready(slot.name)
            return
        try:
            if inspect.iscoroutinefunction(self.on_engine_restarted):
                ready = await self.on_engine_restarted(slot.name, slot.url)
            else:
                ready = await asyncio.to_thread(self.on_engine_restarted, slot.name, slot.url)
        except Exception as err:  # noqa: BLE001 - a failed weight push: replace the engine again
            log.error("on_engine_restarted(%s) failed: %r", slot.name, err)
            self.router.mark_dead(slot.name, f"restart hook failed: {err!r}")
            await self._kill(slot)
            return
        if ready is True:
            self.router.mark_ready(slot.name)

    async def _launch(self, slot: _Slot) -> None:
        slot.actor = self._actor_factory(slot.spec)
        slot.url = await asyncio.wait_for(
            _awaitable(slot.actor.start.remote()), self.config.engine_startup_timeout_s
        )

    async def _kill(self, slot: _Slot) -> None:
        actor, slot.actor = slot.actor, None
        slot.url = ""
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

    def _state(self, name: str) -> EngineState | None:
        try:
            return self.router.state(name)
        except KeyError:
            return None


def _awaitable(ref: Any) -> Awaitable[Any]:
    """A Ray ObjectRef (or a test fake's awaitable) as something asyncio can wait for."""
    if inspect.isawaitable(ref):
        return ref
    raise TypeError(f"expected an awaitable object ref, got {type(ref).__name__}")
