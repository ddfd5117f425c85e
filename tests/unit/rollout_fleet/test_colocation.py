"""The co-location owner's half of the cycle, against fake engines that record every call.

It pauses before it releases and releases only serving engines; it resumes only the tags
it released (weights before the push, the KV cache after it); an engine whose release,
resume or push fails stays out of routing until a later push reaches it; a replacement
process starts with nothing released.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.client import EngineError
from rollout_fleet.colocation import ColocatedEngines, released_bytes
from rollout_fleet.config import ColocateConfig
from rollout_fleet.membership import EngineStatus, Membership, SyncOutcome

GIB = 1024**3


class FakeEngine:
    """Records each call; ``fail`` maps a method name to the error it raises once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple] = []
        self.fail: dict[str, str] = {}

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            raise EngineError(f"http://{self.name}", f"/{method}", 500, self.fail.pop(method))

    async def pause_generation(self, mode: str) -> dict:
        self.calls.append(("pause", mode))
        self._maybe_fail("pause_generation")
        return {}

    async def continue_generation(self) -> dict:
        self.calls.append(("continue",))
        self._maybe_fail("continue_generation")
        return {}

    async def get_server_info(self) -> dict:
        usage = {"weight": 0.5, "kvcache": 2.0, "graph": {"decode": 0.25}}
        return {"internal_states": [{"memory_usage": usage}]}

    async def release_memory_occupation(self, tags) -> None:
        self.calls.append(("release", tuple(tags)))
        self._maybe_fail("release_memory_occupation")

    async def resume_memory_occupation(self, tags) -> None:
        self.calls.append(("resume", tuple(tags)))
        self._maybe_fail("resume_memory_occupation")


def _owner(*names: str, **config) -> tuple[ColocatedEngines, Membership, dict[str, FakeEngine]]:
    membership = Membership()
    engines = {n: FakeEngine(n) for n in names}
    for name in names:
        membership.launch(name, f"http://{name}")
        membership.weights_loaded(name, 0)
    owner = ColocatedEngines(
        ColocateConfig(**config), membership, engines.__getitem__, lambda n: n in engines
    )
    return owner, membership, engines


def _push_done(owner: ColocatedEngines, membership: Membership, failed=None) -> SyncOutcome:
    targets = membership.weight_targets().engines
    outcome = asyncio.run(
        owner.take_back(SyncOutcome(version=1, targets=targets, failed=failed or {}))
    )
    membership.apply_sync(outcome)
    return outcome


def test_one_version_pauses_releases_resumes_weights_pushes_then_kv_and_continues():
    owner, membership, engines = _owner("e0", "e1", pause_mode="retract")
    assert asyncio.run(owner.yield_devices()) == 2
    assert {membership.status(n) for n in engines} == {EngineStatus.RELEASED}
    assert membership.routable() == []
    asyncio.run(owner.prepare_push(["e0", "e1"]))
    _push_done(owner, membership)
    for engine in engines.values():
        assert engine.calls == [
            ("pause", "retract"),
            ("release", ("kv_cache", "weights", "cuda_graph")),
            ("resume", ("cuda_graph", "weights")),  # before the push, SGLang's order
            ("resume", ("kv_cache",)),  # after it
            ("continue",),
        ]
    assert {membership.status(n) for n in engines} == {EngineStatus.READY}
    metrics = owner.metrics()
    assert metrics["colocate/engines_released"] == 2.0
    assert metrics["colocate/bytes_released"] == 2 * int(2.75 * GIB)
    assert {"colocate/release_s", "colocate/resume_weights_s", "colocate/resume_kv_s"} <= set(
        metrics
    )


def test_released_bytes_counts_only_the_released_tags_from_sglangs_memory_usage():
    info = {"internal_states": [{"memory_usage": {"weight": 1.0, "kvcache": 3.0, "graph": {}}}]}
    assert released_bytes(info, ["kv_cache"]) == 3 * GIB
    assert released_bytes(info, ["kv_cache", "weights"]) == 4 * GIB
    assert released_bytes({}, ["weights"]) == 0


def test_kept_weights_are_not_resumed_before_the_push():
    owner, membership, engines = _owner("e0", release=["kv_cache"])
    asyncio.run(owner.yield_devices())
    asyncio.run(owner.prepare_push(["e0"]))
    _push_done(owner, membership)
    assert engines["e0"].calls[1:] == [
        ("release", ("kv_cache",)),
        ("resume", ("kv_cache",)),
        ("continue",),
    ]


def test_an_engine_whose_push_failed_stays_paused_and_out_of_routing_until_one_succeeds():
    owner, membership, engines = _owner("e0", "e1")
    asyncio.run(owner.yield_devices())
    asyncio.run(owner.prepare_push(["e0", "e1"]))
    _push_done(owner, membership, failed={"e0": "push timed out"})
    assert membership.status("e0") is EngineStatus.NEEDS_WEIGHTS
    assert [n for n, _, _ in membership.routable()] == ["e1"]
    assert ("continue",) not in engines["e0"].calls  # paused, its KV cache still released
    asyncio.run(owner.prepare_push(["e0"]))  # the rejoin publish: weights already resumed
    _push_done(owner, membership)
    assert engines["e0"].calls[-2:] == [("resume", ("kv_cache",)), ("continue",)]
    assert membership.status("e0") is EngineStatus.READY


def test_a_failed_release_takes_the_engine_out_and_the_next_push_brings_it_back():
    owner, membership, engines = _owner("e0")
    engines["e0"].fail["release_memory_occupation"] = "busy"
    assert asyncio.run(owner.yield_devices()) == 0
    assert membership.status("e0") is EngineStatus.NEEDS_WEIGHTS
    asyncio.run(owner.prepare_push(["e0"]))  # nothing was released: nothing to resume
    _push_done(owner, membership)
    assert [c[0] for c in engines["e0"].calls] == ["pause", "release", "continue"]
    assert membership.status("e0") is EngineStatus.READY


def test_a_failed_weight_resume_takes_the_engine_out_of_the_push_and_of_routing():
    owner, membership, engines = _owner("e0", "e1")
    asyncio.run(owner.yield_devices())
    engines["e0"].fail["resume_memory_occupation"] = "engine hung"
    assert asyncio.run(owner.prepare_push(["e0", "e1"])) == ["e0"]  # not pushed to
    assert membership.status("e0") is EngineStatus.NEEDS_WEIGHTS  # routed to by nobody
    assert [t.name for t in membership.weight_targets().engines] == ["e0", "e1"]
    _push_done(owner, membership, failed={"e0": "left out: weights not resumed"})
    assert membership.status("e1") is EngineStatus.READY
    assert membership.status("e0") is EngineStatus.NEEDS_WEIGHTS
    assert asyncio.run(owner.prepare_push(["e0"])) == []  # the rejoin: resumed now, pushed
    _push_done(owner, membership)
    assert membership.status("e0") is EngineStatus.READY


def test_a_replacement_starts_with_nothing_released():
    owner, membership, engines = _owner("e0")
    asyncio.run(owner.yield_devices())
    membership.die("e0", "killed while released")
    membership.launch("e0", "http://e0-new")
    membership.require_weights("e0", 0, "replacement")
    engines["e0"].calls.clear()
    asyncio.run(owner.prepare_push(["e0"]))
    _push_done(owner, membership)
    assert engines["e0"].calls == []  # no resume, no continue: the new process was never paused
    assert membership.status("e0") is EngineStatus.READY


@pytest.mark.parametrize("state", ["needs_weights", "released"])
def test_only_serving_engines_give_way(state):
    owner, membership, engines = _owner("e0")
    if state == "needs_weights":
        membership.require_weights("e0", 1, "missed a version")
    else:
        asyncio.run(owner.yield_devices())
        engines["e0"].calls.clear()
    assert asyncio.run(owner.yield_devices()) == 0
    assert engines["e0"].calls == []
