"""Faults in the co-located cycle, on real embedded engines driven as the run drives them.

The rollout side's pieces (``Membership``, ``EngineFleet`` with its health checks and
replacements, ``ColocatedEngines``) run here over embedded engines with the memory saver
on, started in-process by a stand-in for the engine actor; the learner's side is a
``TensorSender``. Each version goes: yield_devices -> (learner step) -> prepare_push ->
push -> take_back -> apply_sync, as ``launcher.session.Run`` calls them.

- An engine that dies while released is replaced by the fleet; the replacement is never
  routable before the next push reaches it, and then holds exactly the pushed weights.
- A push that fails after the weights were resumed leaves the engine paused, its KV
  cache released and out of routing (a request sent to it anyway does not run); the next
  push that succeeds brings it back at the new version.
"""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch

from rollout_fleet.client import EngineClient
from rollout_fleet.colocation import ColocatedEngines
from rollout_fleet.config import ColocateConfig, RolloutConfig
from rollout_fleet.engine.server import EmbeddedEngine
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import EngineStatus, Membership, SyncOutcome, WeightTargets
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineEndpoint
from weight_sync.errors import WeightSyncError
from weight_sync.tensor_push import TensorSender

pytestmark = pytest.mark.timeout(600)


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return await asyncio.to_thread(self.fn, *args)

        return call()


class InProcessEngineActor:
    """What the fleet sees of an engine actor; the engine is an embedded engine in this process."""

    def __init__(self, spec, model_dir, started: list) -> None:
        self.spec = spec
        self.model_dir = model_dir
        self.engine: EmbeddedEngine | None = None
        self.dead = False
        started.append(self)
        self.start = _Method(self._start)
        self.ping = _Method(self._ping)
        self.stop = _Method(self._stop)

    def _start(self) -> str:
        self.engine = EmbeddedEngine(
            self.model_dir, engine_id=self.spec.name, memory_saver=self.spec.memory_saver
        )
        return self.engine.start_server()

    def _ping(self) -> dict:
        if self.dead:
            raise ConnectionError("the engine process exited")
        return {"alive": True}

    def _stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def crash(self) -> None:
        """The process dies: its server stops answering and its actor with it."""
        self._stop()
        self.dead = True

    def kill(self) -> None:
        self._stop()


class Cycle:
    """The rollout side of a co-located run and rank 0's sender, as the driver uses them."""

    def __init__(self, model_dir, engines: int) -> None:
        self.model_dir = model_dir
        self.actors: list[InProcessEngineActor] = []
        self.membership = Membership()
        config = RolloutConfig(
            num_engines=engines, placement="colocated", health_failures_before_dead=1
        )
        self.fleet = EngineFleet(
            config,
            str(model_dir),
            membership=self.membership,
            weights_pushed=True,
            actor_factory=lambda spec: InProcessEngineActor(spec, model_dir, self.actors),
        )
        self.clients: dict[str, EngineClient] = {}
        self.owner = ColocatedEngines(
            ColocateConfig(), self.membership, self._client, lambda n: True
        )
        self.sender = TensorSender(WeightSyncConfig(timeout_s=20, verify_rows=1000))
        self.events: list = []
        self.membership.subscribe(self.events.append)

    def _client(self, name: str) -> EngineClient:
        url = self.membership.url(name)
        if url not in self.clients:
            self.clients[url] = EngineClient(url, timeout_s=20, retries=0)
        return self.clients[url]

    def learner_weights(self, shift: float) -> list[tuple[str, torch.Tensor]]:
        runner = next(a for a in self.actors if a.engine is not None).engine.runner
        torch.manual_seed(int(shift * 100))
        return [(n, torch.randn_like(p) * 0.02 + shift) for n, p in runner.model.named_parameters()]

    async def publish(self, version: int, sent) -> SyncOutcome:
        """weight_targets (with prepare_push), the push, weights_published (take_back)."""
        targets = self.membership.weight_targets()
        unmapped = await self.owner.prepare_push([t.name for t in targets.engines])
        targets = WeightTargets(engines=tuple(t for t in targets.engines if t.name not in unmapped))
        self.sender.set_members(EngineEndpoint(t.name, t.url) for t in targets.engines)
        failed = {}
        try:
            await asyncio.to_thread(self.sender.publish, iter(sent), version)
        except WeightSyncError as err:
            failed = {n: str(err) for n in err.engines}
        outcome = SyncOutcome(version=version, targets=targets.engines, failed=failed)
        outcome = await self.owner.take_back(outcome)
        self.membership.apply_sync(outcome)
        return outcome

    async def close(self) -> None:
        self.sender.close()
        for client in self.clients.values():
            await client.close()
        await self.fleet.stop()


def _held(actor: InProcessEngineActor) -> dict[str, torch.Tensor]:
    return dict(actor.engine.runner.model.named_parameters())


def test_an_engine_that_dies_while_released_is_replaced_and_serves_only_after_the_push(
    tiny_model_dir,
):
    async def scenario():
        cycle = Cycle(tiny_model_dir, engines=2)
        await cycle.fleet.start()
        await cycle.publish(0, cycle.learner_weights(0.0))
        assert [n for n, _, _ in cycle.membership.routable()] == ["engine-0", "engine-1"]
        assert await cycle.owner.yield_devices() == 2
        first = cycle.actors[0]
        first.crash()  # dies while released, during the learner's step
        await cycle.fleet.check_once()
        await cycle.fleet.wait_replacements()
        replacement = cycle.actors[-1]
        assert replacement is not first and replacement.spec.name == "engine-0"
        assert cycle.membership.status("engine-0") is EngineStatus.NEEDS_WEIGHTS
        assert cycle.membership.routable() == []  # engine-1 released, engine-0 behind
        sent = cycle.learner_weights(0.5)
        cycle.events.clear()
        outcome = await cycle.publish(1, sent)
        assert not outcome.failed
        ready = [e for e in cycle.events if e.name == "engine-0" and e.status == "ready"]
        assert len(ready) == 1 and "holds version 1" in ready[0].reason
        for actor in (replacement, cycle.actors[1]):
            held = _held(actor)
            assert all(torch.equal(held[n], t) for n, t in sent)
            info = requests.get(f"{actor.engine.base_url}/model_info", timeout=10).json()
            assert info["weight_version"] == "1"
        assert [n for n, _, _ in cycle.membership.routable()] == ["engine-0", "engine-1"]
        assert cycle.fleet.metrics()["fleet/engine_restarts"] == 1.0
        await cycle.close()

    asyncio.run(scenario())


def test_a_push_that_fails_after_resume_keeps_the_engine_out_until_a_push_succeeds(
    tiny_model_dir,
):
    async def scenario():
        cycle = Cycle(tiny_model_dir, engines=1)
        await cycle.fleet.start()
        await cycle.publish(0, cycle.learner_weights(0.0))
        assert await cycle.owner.yield_devices() == 1
        engine = cycle.actors[0].engine
        real_load = engine.scheduler.load_weights

        def failing_load(tensors, version):  # the engine cannot load this push (e.g. OOM)
            engine.scheduler.load_weights = real_load
            raise RuntimeError("out of memory while loading")

        engine.scheduler.load_weights = failing_load
        outcome = await cycle.publish(1, cycle.learner_weights(0.5))
        assert "out of memory" in outcome.failed["engine-0"]
        assert cycle.membership.status("engine-0") is EngineStatus.NEEDS_WEIGHTS
        assert cycle.membership.routable() == []
        info = requests.get(f"{engine.base_url}/server_info", timeout=10).json()
        state = info["internal_states"][0]
        # still paused as the cycle paused it (the default, retract), its KV cache released
        assert state["paused"] == ColocateConfig().pause_mode == "retract"
        assert state["memory_usage"]["kvcache"] == 0.0
        stray = asyncio.ensure_future(
            asyncio.to_thread(
                requests.post,
                f"{engine.base_url}/generate",
                json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}},
                timeout=60,
            )
        )
        await asyncio.sleep(1.0)
        assert not stray.done()  # a request that reaches it anyway does not run
        sent = cycle.learner_weights(0.7)
        outcome = await cycle.publish(1, sent)  # the driver's rejoin: the same version again
        assert not outcome.failed
        assert cycle.membership.status("engine-0") is EngineStatus.READY
        reply = (await stray).json()
        assert reply["meta_info"]["weight_version"] == "1"  # it ran on the pushed weights
        held = _held(cycle.actors[0])
        assert all(torch.equal(held[n], t) for n, t in sent)
        await cycle.close()

    asyncio.run(scenario())
