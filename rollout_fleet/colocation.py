"""The rollout side of co-location: engines give their devices to the learner for each step.

With ``rollout.placement: colocated`` engine i runs on learner rank i's device. Per
version the devices change hands twice; this owner drives the engines' half of it
through SGLang's routes, and keeps the one piece of state the cycle adds: which memory
each engine has released (by incarnation: a replacement starts with all of its own)::

    yield_devices()        for every serving co-located engine:
                             membership.release        no new requests are routed to it
                             /pause_generation(mode)   abort: partials return to the worker,
                                                       which resubmits them later; retract:
                                                       they wait in the engine's queue
                             /server_info              memory_usage: what the release frees
                             /release_memory_occupation(tags)
        ... learner rank i onloads, steps ...
    prepare_push()         /resume_memory_occupation(cuda_graph, weights) where released,
                           in SGLang's order, so the push lands in allocated memory; an
                           engine whose resume fails is left out of the push (its
                           weights are not mapped) and out of routing
        ... learner rank i pushes /update_weights_from_tensor in a begin/end session ...
    take_back(outcome)     for each engine that holds the version:
                             /resume_memory_occupation(kv_cache), /continue_generation;
                           the outcome then goes to the membership (``apply_sync``):
                           those READY, the others NEEDS_WEIGHTS

An engine whose push failed stays paused and out of routing, its KV cache still
released: it never serves the garbage its resumed weights hold. One whose weight resume
failed is not pushed to at all (it needs its weights: ``require_weights``). The next
publish that reaches it (the driver's rejoin) is followed by ``take_back`` again, which resumes and
continues it. An engine that fails a call here is taken out the same way
(``require_weights``), and one that dies while released is replaced by the fleet;
the replacement has released nothing and gets the weights before it serves.

Admission and per-token versions are untouched: groups may still be admitted while
engines are released (their requests wait for a routable engine), every token carries
the version of the weights that produced it, and a sample resubmitted across versions
is bounded by its oldest token.

Metrics (``metrics()``, per cycle): ``colocate/release_s`` (pause and release),
``colocate/resume_weights_s``, ``colocate/resume_kv_s`` (with continue),
``colocate/bytes_released`` (what the engines reported their released tags held), and
``colocate/engines_released``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleetrl.log import get_logger
from rollout_fleet.client import EngineError
from rollout_fleet.config import ColocateConfig
from rollout_fleet.membership import SERVING, Membership, MembershipError, SyncOutcome

log = get_logger(__name__)

WEIGHT_TAGS = ("cuda_graph", "weights")  # resumed before the push, in SGLang's order
KV_TAG = "kv_cache"
GIB = 1024**3
USAGE_KEYS = {"weights": "weight", "kv_cache": "kvcache"}  # tag -> memory_usage key (GiB)


@dataclass
class EngineMemory:
    """What one engine process (``incarnation``) has released, and whether we paused it."""

    incarnation: int
    released: set[str] = field(default_factory=set)
    paused: bool = False


def released_bytes(server_info: dict[str, Any], tags: list[str]) -> int:
    """Bytes the released ``tags`` hold, from SGLang's ``internal_states[0].memory_usage``
    (GiB; ``graph`` a dict of phases). 0 when the engine does not report it."""
    states = server_info.get("internal_states") or [{}]
    first = states[0] if isinstance(states[0], dict) else {}
    usage = first.get("memory_usage") or {}
    total = sum(float(usage.get(USAGE_KEYS[t], 0.0) or 0.0) for t in tags if t in USAGE_KEYS)
    graph = usage.get("graph")
    if "cuda_graph" in tags and isinstance(graph, dict):
        total += sum(float(v) for v in graph.values() if isinstance(v, int | float))
    return int(total * GIB)


class ColocatedEngines:
    """The co-located engines' memory and pause state; see the module docstring."""

    def __init__(
        self,
        config: ColocateConfig,
        membership: Membership,
        client_for: Callable[[str], Any],
        colocated: Callable[[str], bool],
    ) -> None:
        self.config = config
        self.membership = membership
        self._client_for = client_for  # engine name -> rollout_fleet.client.EngineClient
        self._colocated = colocated  # whether an engine shares a learner rank's device
        self._memory: dict[str, EngineMemory] = {}
        self._metrics: dict[str, float] = {}

    def _record(self, name: str) -> EngineMemory:
        """The memory record of the process now serving ``name`` (fresh for a replacement)."""
        incarnation = self.membership.incarnation(name)
        record = self._memory.get(name)
        if record is None or record.incarnation != incarnation:
            record = self._memory[name] = EngineMemory(incarnation)
        return record

    def _engines(self) -> list[str]:
        return [n for n in self.membership.names() if self._colocated(n)]

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    # ---- before the learner's step ------------------------------------------------------

    async def yield_devices(self) -> int:
        """Pause and release every serving co-located engine; how many gave way."""
        started = time.perf_counter()
        serving = [n for n in self._engines() if self.membership.status(n) in SERVING]
        results = await asyncio.gather(*(self._yield_one(n) for n in serving))
        released = [n for n, nbytes in zip(serving, results, strict=True) if nbytes is not None]
        self._metrics = {
            "colocate/release_s": time.perf_counter() - started,
            "colocate/bytes_released": float(sum(b for b in results if b is not None)),
            "colocate/engines_released": float(len(released)),
        }
        return len(released)

    async def _yield_one(self, name: str) -> int | None:
        record = self._record(name)
        try:
            self.membership.release(name, "learner step", incarnation=record.incarnation)
        except MembershipError as err:  # it stopped serving meanwhile
            log.info("engine %s not released: %s", name, err)
            return None
        client = self._client_for(name)
        tags = list(self.config.release)
        try:
            await client.pause_generation(self.config.pause_mode)
            record.paused = True
            info = await client.get_server_info()
            await client.release_memory_occupation(tags)
        except EngineError as err:
            self._take_out(name, record, f"could not release its memory: {err}")
            return None
        record.released.update(tags)
        return released_bytes(info, tags)

    # ---- around the push ----------------------------------------------------------------

    async def prepare_push(self, names: list[str]) -> list[str]:
        """Resume the weight memory (cuda_graph, weights) of the released engines among
        ``names``; the engines that could not resume, taken out of routing: the push must
        leave them out (SGLang would write the weights into unmapped memory)."""
        started = time.perf_counter()
        mine = [n for n in names if self._colocated(n)]
        resumed = await asyncio.gather(*(self._resume_weights(n) for n in mine))
        self._metrics["colocate/resume_weights_s"] = time.perf_counter() - started
        return [n for n, ok in zip(mine, resumed, strict=True) if not ok]

    async def _resume_weights(self, name: str) -> bool:
        """Whether ``name``'s weight memory is mapped (resumed now, or never released)."""
        record = self._record(name)
        tags = [t for t in WEIGHT_TAGS if t in record.released]
        if not tags:
            return True
        try:
            await self._client_for(name).resume_memory_occupation(tags)
        except EngineError as err:
            self._take_out(name, record, f"could not resume {tags} before the push: {err}")
            return False
        record.released.difference_update(tags)
        return True

    async def take_back(self, outcome: SyncOutcome) -> SyncOutcome:
        """Resume the KV cache and continue every co-located engine that holds the version;
        the outcome with the engines that failed here added to ``failed``."""
        started = time.perf_counter()
        holders = [
            t.name
            for t in outcome.targets
            if self._colocated(t.name)
            and t.name not in outcome.failed
            and t.name not in outcome.partial
        ]
        problems = await asyncio.gather(*(self._continue(n) for n in holders))
        failed = {n: p for n, p in zip(holders, problems, strict=True) if p}
        self._metrics["colocate/resume_kv_s"] = time.perf_counter() - started
        if not failed:
            return outcome
        return msgspec.structs.replace(outcome, failed={**outcome.failed, **failed})

    async def _continue(self, name: str) -> str:
        """'' once ``name`` runs again, else why not."""
        record = self._record(name)
        client = self._client_for(name)
        try:
            if KV_TAG in record.released:
                await client.resume_memory_occupation([KV_TAG])
                record.released.discard(KV_TAG)
            if record.released:  # a weight resume failed before the push: it cannot serve
                return f"memory {sorted(record.released)} still released"
            if record.paused:
                await client.continue_generation()
                record.paused = False
        except EngineError as err:
            return f"could not resume after the push: {err}"
        return ""

    def _take_out(self, name: str, record: EngineMemory, reason: str) -> None:
        log.error("engine %s: %s; it stays out of routing until a push reaches it", name, reason)
        try:
            latest = self.membership.latest_version
            self.membership.require_weights(name, latest, reason, incarnation=record.incarnation)
        except MembershipError as err:
            log.info("engine %s: %s", name, err)
