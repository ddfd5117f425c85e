"""Engine membership: every action from every state is legal exactly as ``RULES`` says
(illegal ones raise and change nothing), events, incarnations, and weight-sync outcomes."""

from __future__ import annotations

import pytest

from rollout_fleet.membership import (
    RULES,
    EngineStatus,
    EngineTarget,
    IllegalTransition,
    Membership,
    StaleIncarnation,
    SyncOutcome,
    UnknownEngineError,
)

S = EngineStatus

# the state each action leads to when legal
RESULT = {
    "place": S.PLACING,
    "launch": S.STARTING,
    "weights_loaded": S.READY,
    "require_weights": S.NEEDS_WEIGHTS,
    "suspect": S.SUSPECT,
    "clear_suspect": S.READY,
    "drain": S.DRAINING,
    "die": S.DEAD,
    "remove": None,  # forgotten
    "release": S.RELEASED,
}

# the legal table written out once more by hand, so a change to RULES must be deliberate
LEGAL = {
    ("place", None), ("place", S.DEAD), ("launch", S.PLACING), ("die", S.PLACING),
    ("drain", S.PLACING),
    ("launch", None), ("launch", S.DEAD),
    ("weights_loaded", S.STARTING), ("weights_loaded", S.NEEDS_WEIGHTS),
    ("weights_loaded", S.READY), ("weights_loaded", S.SUSPECT),
    ("require_weights", S.STARTING), ("require_weights", S.NEEDS_WEIGHTS),
    ("require_weights", S.READY), ("require_weights", S.SUSPECT),
    ("suspect", S.READY), ("suspect", S.SUSPECT),
    ("clear_suspect", S.SUSPECT),
    ("drain", S.STARTING), ("drain", S.NEEDS_WEIGHTS), ("drain", S.READY), ("drain", S.SUSPECT),
    ("die", S.STARTING), ("die", S.NEEDS_WEIGHTS), ("die", S.READY), ("die", S.SUSPECT),
    ("die", S.DRAINING),
    ("remove", S.DRAINING), ("remove", S.DEAD),
    ("release", S.READY), ("release", S.SUSPECT),
    ("weights_loaded", S.RELEASED), ("require_weights", S.RELEASED),
    ("drain", S.RELEASED), ("die", S.RELEASED),
}  # fmt: skip


def in_state(status: EngineStatus | None) -> Membership:
    """A membership holding engine 'e' in ``status`` (None: not known)."""
    m = Membership()
    if status is None:
        return m
    if status is S.PLACING:
        m.place("e", "node-a")
        return m
    m.launch("e", "http://e")
    path = {
        S.STARTING: [],
        S.NEEDS_WEIGHTS: [lambda: m.require_weights("e", 1, "missed")],
        S.READY: [lambda: m.weights_loaded("e", 0)],
        S.SUSPECT: [lambda: m.weights_loaded("e", 0), lambda: m.suspect("e", "slow")],
        S.DRAINING: [lambda: m.drain("e")],
        S.DEAD: [lambda: m.die("e", "killed")],
        S.RELEASED: [lambda: m.weights_loaded("e", 0), lambda: m.release("e", "learner step")],
    }[status]
    for step in path:
        step()
    assert m.status("e") is status
    return m


def act(m: Membership, action: str) -> None:
    calls = {
        "place": lambda: m.place("e", "node-b"),
        "launch": lambda: m.launch("e", "http://e2"),
        "weights_loaded": lambda: m.weights_loaded("e", 5),
        "require_weights": lambda: m.require_weights("e", 5, "behind"),
        "suspect": lambda: m.suspect("e", "slow"),
        "clear_suspect": lambda: m.clear_suspect("e"),
        "drain": lambda: m.drain("e"),
        "die": lambda: m.die("e", "gone"),
        "remove": lambda: m.remove("e"),
        "release": lambda: m.release("e", "learner step"),
    }
    calls[action]()


STATES: list[EngineStatus | None] = [None, *EngineStatus]
ALL = [(a, s) for a in RESULT for s in STATES]


def test_the_rule_table_is_the_one_written_here():
    assert {(a, s) for a, froms in RULES.items() for s in froms} == LEGAL


@pytest.mark.parametrize(("action", "start"), sorted(LEGAL, key=str))
def test_every_legal_transition_reaches_its_state(action, start):
    m = in_state(start)
    act(m, action)
    if RESULT[action] is None:
        assert m.names() == []
    else:
        assert m.status("e") is RESULT[action]


@pytest.mark.parametrize(("action", "start"), sorted((x for x in ALL if x not in LEGAL), key=str))
def test_every_illegal_transition_raises_and_changes_nothing(action, start):
    m = in_state(start)
    before = m.snapshot()
    error = UnknownEngineError if start is None else IllegalTransition
    with pytest.raises(error, match="'e'"):
        act(m, action)
    assert m.snapshot() == before


def test_an_illegal_transition_names_the_action_and_the_states_it_is_allowed_from():
    m = in_state(S.DEAD)
    with pytest.raises(
        IllegalTransition, match=r"cannot suspect from dead; allowed from ready, suspect"
    ):
        m.suspect("e", "slow")


def test_an_engine_that_needs_a_version_is_not_ready_with_an_older_one():
    m = in_state(S.READY)
    m.require_weights("e", 4, "missed version 4")
    with pytest.raises(IllegalTransition, match="needs version 4"):
        m.weights_loaded("e", 3)
    assert m.status("e") is S.NEEDS_WEIGHTS
    m.weights_loaded("e", 4)
    assert m.status("e") is S.READY


def test_a_replacement_is_a_new_incarnation_and_reports_about_the_old_one_are_refused():
    m = in_state(S.READY)
    old = m.incarnation("e")
    m.die("e", "killed")
    new = m.launch("e", "http://e2")
    assert new != old and m.url("e") == "http://e2"
    with pytest.raises(StaleIncarnation):
        m.suspect("e", "late failure", incarnation=old)
    with pytest.raises(StaleIncarnation):
        m.weights_loaded("e", 0, incarnation=old)
    assert m.status("e") is S.STARTING


def test_listeners_hear_each_change_once_with_url_and_reason():
    m = Membership()
    events = []
    m.subscribe(events.append)
    m.launch("a", "http://a")
    m.weights_loaded("a", 0)
    m.weights_loaded("a", 1)  # READY -> READY: no event
    m.suspect("a", "boom")
    m.suspect("a", "again")  # no change: no event
    m.die("a", "gone")
    m.remove("a")
    assert [(e.name, e.status, e.url, e.removed) for e in events] == [
        ("a", S.STARTING, "http://a", False),
        ("a", S.READY, "http://a", False),
        ("a", S.SUSPECT, "http://a", False),
        ("a", S.DEAD, "http://a", False),
        ("a", S.DEAD, "http://a", True),
    ]
    assert events[3].reason == "gone"


def test_suspects_return_to_ready_after_the_cooldown():
    now = [0.0]
    m = Membership(suspect_cooldown_s=10.0, clock=lambda: now[0])
    for name in ("a", "b"):
        m.launch(name, f"http://{name}")
        m.weights_loaded(name, 0)
    m.suspect("a", "slow")
    assert [n for n, _, _ in m.routable()] == ["b"]
    now[0] = 10.5
    assert [n for n, _, _ in m.routable()] == ["a", "b"]
    assert m.status("a") is S.READY


def test_weight_targets_are_the_live_engines_and_behind_those_not_yet_serving():
    m = Membership()
    for name in ("a", "b", "c", "d", "e"):
        m.launch(name, f"http://{name}")
    m.weights_loaded("a", 0)
    m.require_weights("b", 2, "missed")
    m.drain("d")
    m.die("e", "gone")
    targets = m.weight_targets()
    assert [t.name for t in targets.engines] == ["a", "b", "c"]
    assert targets.engines[1] == EngineTarget(name="b", url="http://b", incarnation=2)
    assert m.behind() == ["b", "c"]
    assert [t.name for t in m.weight_targets(exclude={"c"}).engines] == ["a", "b"]


def test_a_sync_outcome_makes_holders_ready_and_the_others_need_the_version():
    m = Membership()
    for name in ("ok", "failed", "partial", "replaced"):
        m.launch(name, f"http://{name}")
    targets = m.weight_targets().engines
    m.die("replaced", "killed during the sync")
    m.launch("replaced", "http://replaced2")
    m.apply_sync(
        SyncOutcome(
            version=3,
            targets=targets,
            failed={"failed": "timed out"},
            partial=("partial",),
        )
    )
    assert m.status("ok") is S.READY
    assert m.status("failed") is S.NEEDS_WEIGHTS
    assert m.status("partial") is S.NEEDS_WEIGHTS
    assert m.status("replaced") is S.STARTING  # the outcome was about its predecessor
    assert m.latest_version == 0  # a partial version is not delivered
    m.apply_sync(SyncOutcome(version=3, targets=m.weight_targets().engines))
    assert {m.status(n) for n in m.names()} == {S.READY}
    assert m.latest_version == 3


def test_urls_are_those_of_running_processes():
    m = in_state(S.DEAD)
    m.launch("x", "http://x")
    assert m.urls() == {"x": "http://x"}
    assert m.snapshot()["e"]["state"] == "dead"


def test_a_released_engine_is_never_routed_and_only_a_push_that_reaches_it_returns_it():
    m = in_state(S.RELEASED)
    m.launch("f", "http://f")
    m.weights_loaded("f", 0)
    assert [name for name, _, _ in m.routable()] == ["f"]
    assert [t.name for t in m.weight_targets().engines] == ["e", "f"]  # the next push reaches it
    assert m.behind() == []  # released on purpose: not an engine that missed a version
    target = m.weight_targets().engines[0]
    m.apply_sync(SyncOutcome(version=1, targets=(target,), failed={"e": "push timed out"}))
    assert m.status("e") is S.NEEDS_WEIGHTS and "e" not in [n for n, _, _ in m.routable()]
    m.apply_sync(SyncOutcome(version=1, targets=(target,)))
    assert m.status("e") is S.READY


def test_a_placed_engine_keeps_its_incarnation_and_node_when_it_starts_and_is_never_routed_before():
    m = Membership()
    events = []
    m.subscribe(events.append)
    placed = m.place("e", "node-a")
    assert m.status("e") is S.PLACING and m.node("e") == "node-a"
    assert m.urls() == {} and m.routable() == [] and m.weight_targets().engines == ()
    assert m.behind() == []  # nothing to send weights to before it has a URL
    assert m.launch("e", "http://e") == placed  # the same process, now serving
    assert m.status("e") is S.STARTING and m.urls() == {"e": "http://e"}
    assert m.node("e") == "node-a" and m.behind() == ["e"]
    assert [(e.status, e.url) for e in events] == [(S.PLACING, ""), (S.STARTING, "http://e")]


def test_engines_are_found_by_the_node_they_run_on():
    m = Membership()
    m.launch("a", "http://a", node="n1")
    m.launch("b", "http://b", node="n2")
    m.place("c", "n1")
    m.launch("d", "http://d", node="n1")
    m.die("d", "gone")
    assert m.on_node("n1") == ["a", "c"]  # placing counts, dead does not
    assert m.snapshot()["a"]["node"] == "n1"
    assert m.count({S.STARTING, S.PLACING}) == 3
    assert m.in_state({S.PLACING}) == ["c"]
