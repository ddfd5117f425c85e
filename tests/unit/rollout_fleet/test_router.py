"""Router policy: least outstanding requests, group affinity, engine states, leases, events."""

from __future__ import annotations

import pytest

from rollout_fleet.router import EngineState, Router, UnknownEngineError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(*names: str, cooldown: float = 30.0) -> tuple[Router, FakeClock]:
    clock = FakeClock()
    router = Router(suspect_cooldown_s=cooldown, clock=clock)
    for name in names:
        router.add_engine(name, f"http://{name}")
    return router, clock


def test_new_groups_go_to_the_engine_with_fewest_outstanding_requests():
    router, _ = make_router("a", "b", "c")
    first = router.acquire("g1")
    router.acquire("g1")  # same group: same engine, now 2 outstanding there
    second = router.acquire("g2")
    third = router.acquire("g3")
    assert len({first.engine, second.engine, third.engine}) == 3
    router.release(second)
    # b-or-whichever got g2 is now empty: the next new group goes there
    assert router.acquire("g4").engine == second.engine


def test_all_samples_of_a_group_stay_on_one_engine_even_when_it_is_busier():
    router, _ = make_router("a", "b")
    leases = [router.acquire("g") for _ in range(4)]
    assert {lease.engine for lease in leases} == {leases[0].engine}
    assert router.outstanding(leases[0].engine) == 4
    assert router.engine_of("g") == leases[0].engine


def test_finishing_a_group_unpins_it():
    router, _ = make_router("a", "b")
    lease = router.acquire("g")
    router.release(lease)
    router.finish_group("g")
    assert router.engine_of("g") is None


def test_dead_engine_is_never_routed_to_and_its_groups_move():
    router, _ = make_router("a", "b")
    lease = router.acquire("g")
    router.mark_dead(lease.engine, "test")
    other = router.acquire("g")
    assert other.engine != lease.engine
    assert router.engine_of("g") == other.engine
    for i in range(10):
        assert router.acquire(f"x{i}").engine == other.engine


def test_suspect_engine_is_used_only_when_no_ready_engine_exists():
    router, _ = make_router("a", "b")
    router.mark_suspect("a", "timeout")
    assert router.routable() == ["b"]
    assert all(router.acquire(f"g{i}").engine == "b" for i in range(5))
    router.mark_dead("b")
    assert router.acquire("g9").engine == "a"


def test_suspect_engine_returns_after_cooldown():
    router, clock = make_router("a", "b", cooldown=10.0)
    router.mark_suspect("a")
    assert router.state("a") is EngineState.SUSPECT
    clock.now = 10.5
    assert router.routable() == ["a", "b"]
    assert router.state("a") is EngineState.READY


def test_group_pinned_to_an_engine_that_turned_suspect_moves_to_a_ready_one():
    router, _ = make_router("a", "b")
    lease = router.acquire("g")
    router.mark_suspect(lease.engine)
    assert router.acquire("g").engine != lease.engine


def test_starting_engine_gets_no_requests_until_marked_ready():
    router, _ = make_router("a")
    router.add_engine("b", "http://b", ready=False)
    assert all(router.acquire(f"g{i}").engine == "a" for i in range(3))
    router.mark_ready("b")
    assert router.acquire("new").engine == "b"


def test_no_routable_engine_returns_none():
    router, _ = make_router("a")
    router.mark_dead("a")
    assert router.acquire("g") is None
    empty, _ = make_router()
    assert empty.acquire("g") is None


def test_release_from_before_a_restart_does_not_change_the_new_engines_count():
    router, _ = make_router("a")
    old = router.acquire("g")
    router.mark_dead("a")
    router.add_engine("a", "http://a2", ready=True)
    new = router.acquire("h")
    router.release(old)
    assert router.outstanding("a") == 1
    router.release(new)
    assert router.outstanding("a") == 0


def test_dead_engine_must_be_re_added_not_marked_ready():
    router, _ = make_router("a")
    router.mark_dead("a")
    with pytest.raises(ValueError, match="dead"):
        router.mark_ready("a")


def test_adding_a_live_engine_twice_is_an_error():
    router, _ = make_router("a")
    with pytest.raises(ValueError, match="already registered"):
        router.add_engine("a", "http://x")


def test_unknown_engine_names_the_engine():
    router, _ = make_router("a")
    with pytest.raises(UnknownEngineError, match="'zz'"):
        router.mark_dead("zz")


def test_removed_engine_disappears_and_its_groups_move():
    router, _ = make_router("a", "b")
    lease = router.acquire("g")
    router.remove_engine(lease.engine)
    assert lease.engine not in router.names()
    assert router.acquire("g").engine != lease.engine
    router.release(lease)  # a late release for a removed engine is harmless


def test_listeners_hear_every_state_change_with_url():
    router, _ = make_router("a")
    events = []
    router.subscribe(events.append)
    router.add_engine("b", "http://b", ready=False)
    router.mark_ready("b", url="http://b:2")
    router.mark_suspect("a", "boom")
    router.mark_suspect("a", "again")  # no change: no event
    router.mark_dead("a", "gone")
    assert [(e.name, e.state, e.url) for e in events] == [
        ("b", EngineState.STARTING, "http://b"),
        ("b", EngineState.READY, "http://b:2"),
        ("a", EngineState.SUSPECT, "http://a"),
        ("a", EngineState.DEAD, "http://a"),
    ]
    assert events[-1].reason == "gone"


def test_mark_suspect_on_a_dead_or_removed_engine_is_ignored():
    router, _ = make_router("a")
    router.mark_dead("a")
    router.mark_suspect("a")
    assert router.state("a") is EngineState.DEAD
    router.mark_suspect("never-existed")


def test_snapshot_reports_per_engine_load():
    router, _ = make_router("a", "b")
    router.acquire("g")
    snap = router.snapshot()
    assert sum(v["outstanding"] for v in snap.values()) == 1
    assert sum(v["groups"] for v in snap.values()) == 1
    assert {v["state"] for v in snap.values()} == {"ready"}
