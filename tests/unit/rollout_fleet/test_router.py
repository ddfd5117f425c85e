"""Router policy over the membership's engines: least outstanding requests, group affinity,
leases across restarts; which engines are routable is the membership's answer."""

from __future__ import annotations

import pytest

from rollout_fleet.membership import EngineStatus, Membership, UnknownEngineError
from rollout_fleet.router import Router


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(*names: str, cooldown: float = 30.0) -> tuple[Router, Membership, FakeClock]:
    clock = FakeClock()
    members = Membership(suspect_cooldown_s=cooldown, clock=clock)
    router = Router(members)
    for name in names:
        members.launch(name, f"http://{name}")
        members.weights_loaded(name, 0)
    return router, members, clock


def test_new_groups_go_to_the_engine_with_fewest_outstanding_requests():
    router, _, _ = make_router("a", "b", "c")
    first = router.acquire("g1")
    router.acquire("g1")  # same group: same engine, now 2 outstanding there
    second = router.acquire("g2")
    third = router.acquire("g3")
    assert len({first.engine, second.engine, third.engine}) == 3
    router.release(second)
    # b-or-whichever got g2 is now empty: the next new group goes there
    assert router.acquire("g4").engine == second.engine


def test_all_samples_of_a_group_stay_on_one_engine_even_when_it_is_busier():
    router, _, _ = make_router("a", "b")
    leases = [router.acquire("g") for _ in range(4)]
    assert {lease.engine for lease in leases} == {leases[0].engine}
    assert router.outstanding(leases[0].engine) == 4
    assert router.engine_of("g") == leases[0].engine


def test_finishing_a_group_unpins_it():
    router, _, _ = make_router("a", "b")
    lease = router.acquire("g")
    router.release(lease)
    router.finish_group("g")
    assert router.engine_of("g") is None


def test_dead_engine_is_never_routed_to_and_its_groups_move():
    router, members, _ = make_router("a", "b")
    lease = router.acquire("g")
    members.die(lease.engine, "test")
    assert router.engine_of("g") is None  # unpinned when it died
    other = router.acquire("g")
    assert other.engine != lease.engine
    assert router.engine_of("g") == other.engine
    for i in range(10):
        assert router.acquire(f"x{i}").engine == other.engine


def test_engine_that_needs_weights_gets_no_requests_until_it_holds_them():
    router, members, _ = make_router("a", "b")
    members.require_weights("a", 3, "missed version 3")
    assert all(router.acquire(f"g{i}").engine == "b" for i in range(4))
    members.weights_loaded("a", 3)
    assert router.acquire("new").engine == "a"


def test_suspect_engine_is_used_only_when_no_ready_engine_exists():
    router, members, _ = make_router("a", "b")
    members.suspect("a", "timeout")
    assert router.routable() == ["b"]
    assert all(router.acquire(f"g{i}").engine == "b" for i in range(5))
    members.die("b", "gone")
    assert router.acquire("g9").engine == "a"


def test_suspect_engine_returns_after_cooldown():
    router, members, clock = make_router("a", "b", cooldown=10.0)
    members.suspect("a", "timeout")
    assert router.state("a") is EngineStatus.SUSPECT
    clock.now = 10.5
    assert router.routable() == ["a", "b"]
    assert router.state("a") is EngineStatus.READY


def test_group_pinned_to_an_engine_that_turned_suspect_moves_to_a_ready_one():
    router, members, _ = make_router("a", "b")
    lease = router.acquire("g")
    members.suspect(lease.engine, "timeout")
    assert router.acquire("g").engine != lease.engine


def test_starting_engine_gets_no_requests_until_it_holds_weights():
    router, members, _ = make_router("a")
    members.launch("b", "http://b")
    assert all(router.acquire(f"g{i}").engine == "a" for i in range(3))
    members.weights_loaded("b", 0)
    assert router.acquire("new").engine == "b"


def test_no_routable_engine_returns_none():
    router, members, _ = make_router("a")
    members.die("a", "gone")
    assert router.acquire("g") is None
    empty, _, _ = make_router()
    assert empty.acquire("g") is None


def test_release_from_before_a_restart_does_not_change_the_new_engines_count():
    router, members, _ = make_router("a")
    old = router.acquire("g")
    members.die("a", "gone")
    members.launch("a", "http://a2")
    members.weights_loaded("a", 0)
    new = router.acquire("h")
    router.release(old)
    assert router.outstanding("a") == 1
    router.release(new)
    assert router.outstanding("a") == 0


def test_unknown_engine_names_the_engine():
    router, _, _ = make_router("a")
    with pytest.raises(UnknownEngineError, match="'zz'"):
        router.outstanding("zz")


def test_removed_engine_disappears_and_its_groups_move():
    router, members, _ = make_router("a", "b")
    lease = router.acquire("g")
    members.drain(lease.engine)
    assert router.acquire("g").engine != lease.engine  # draining: no new requests
    members.remove(lease.engine)
    assert lease.engine not in router.snapshot()
    router.release(lease)  # a late release for a removed engine is harmless


def test_snapshot_reports_per_engine_load_beside_the_membership_state():
    router, _, _ = make_router("a", "b")
    router.acquire("g")
    snap = router.snapshot()
    assert sum(v["outstanding"] for v in snap.values()) == 1
    assert sum(v["groups"] for v in snap.values()) == 1
    assert {v["state"] for v in snap.values()} == {"ready"}
