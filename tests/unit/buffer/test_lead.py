"""The admission lead: the fewest versions ahead that keep the learner fed, never past η."""

from __future__ import annotations

import pytest

from buffer.admission import StalenessAdmission
from buffer.lead import LOWER_AFTER, WARMUP, AdmissionLead
from buffer.wire import AdmissionState

B = 4  # groups per version
STEP = 1.0  # seconds between hand-outs


def _steady(lead: AdmissionLead, handouts: int, *, clock: list[float], ready_after: int = 0):
    """Hand-outs one step apart, each ready at once, with ``ready_after`` groups beyond it."""
    for _ in range(handouts):
        clock[0] += STEP
        lead.handed_out(clock[0], ready_after)


def _waited(lead: AdmissionLead, seconds: float, clock: list[float]) -> None:
    """The learner asks at the end of a step and waits ``seconds`` for its batch."""
    clock[0] += STEP
    lead.waiting(clock[0])
    clock[0] += seconds
    lead.handed_out(clock[0], 0)


def test_a_learner_that_waits_raises_the_lead_up_to_the_bound_and_not_beyond():
    lead, clock = AdmissionLead(3, B, "adaptive"), [0.0]
    assert lead.lead == 1
    _steady(lead, WARMUP, clock=clock)
    _waited(lead, 0.5, clock)
    assert lead.lead == 2 and lead.raised == 1
    _waited(lead, 0.5, clock)  # the fleet is still catching up: no second raise at once
    assert lead.lead == 2
    _waited(lead, 0.5, clock)
    _waited(lead, 0.5, clock)
    _waited(lead, 0.5, clock)
    assert lead.lead == 3  # the bound
    _waited(lead, 0.01, clock)  # a wait under WAIT_SHARE of a step is not falling behind
    assert lead.lead == 3


def test_a_versions_surplus_in_a_row_lowers_the_lead_but_not_below_one():
    lead, clock = AdmissionLead(3, B, "adaptive"), [0.0]
    _steady(lead, WARMUP, clock=clock)
    for _ in range(3):
        _waited(lead, 0.5, clock)
    assert lead.lead == 3
    _steady(lead, LOWER_AFTER - 1, clock=clock, ready_after=B)
    _steady(lead, 1, clock=clock, ready_after=B - 1)  # the streak breaks
    assert lead.lead == 3
    _steady(lead, LOWER_AFTER, clock=clock, ready_after=B)
    assert lead.lead == 2 and lead.lowered == 1
    _steady(lead, 10 * LOWER_AFTER, clock=clock, ready_after=2 * B)
    assert lead.lead == 1


def test_warm_up_hand_outs_only_measure():
    lead, clock = AdmissionLead(4, B, "adaptive"), [0.0]
    for _ in range(WARMUP):
        _waited(lead, 5.0, clock)
    assert lead.lead == 1 and lead.raised == 0


@pytest.mark.parametrize(("eta", "mode", "expected"), [(0, "adaptive", 0), (1, "adaptive", 1),
                                                       (4, "bound", 4), (2, "adaptive", 1)])  # fmt: skip
def test_the_bound_mode_and_small_bounds_do_not_adapt(eta, mode, expected):
    lead, clock = AdmissionLead(eta, B, mode), [0.0]
    assert lead.lead == expected
    if mode == "bound" or eta <= 1:
        _steady(lead, WARMUP, clock=clock)
        for _ in range(5):
            _waited(lead, 0.9, clock)
        _steady(lead, 10, clock=clock, ready_after=10 * B)
        assert lead.lead == expected


def test_the_admission_window_uses_the_lead_within_the_bound():
    assert StalenessAdmission(4, B, 100, lead=1).window_end(3) == (1 + 3 + 1) * B
    assert StalenessAdmission(4, B, 100, lead=9).window_end(3) == (4 + 3 + 1) * B
    assert StalenessAdmission(4, B, 100).window_end(3) == (4 + 3 + 1) * B
    state = AdmissionState(policy_version=0, accepted_groups=0, max_staleness=4,
                           groups_per_version=B, max_concurrent=100, lead=2)  # fmt: skip
    assert StalenessAdmission.from_state(state).lead == 2
    older = AdmissionState(policy_version=0, accepted_groups=0, max_staleness=4,
                           groups_per_version=B, max_concurrent=100)  # fmt: skip
    assert StalenessAdmission.from_state(older).lead is None  # an older buffer: the bound


def test_the_buffer_reports_its_lead_to_producers_and_in_its_stats(tmp_path, monkeypatch):
    from buffer import core as core_module
    from buffer.config import BufferConfig
    from buffer.core import BufferCore
    from buffer.synthetic import make_group

    clock = [100.0]
    monkeypatch.setattr(core_module.time, "monotonic", lambda: clock[0])
    config = BufferConfig(max_staleness=3, admission_lead="adaptive")
    core = BufferCore(config, bank_dir=tmp_path, groups_per_version=1, max_concurrent_groups=16)
    assert core.admission_state().lead == 1
    for i in range(WARMUP + 1):  # the third request waits half a step for its group
        clock[0] += STEP
        if i == WARMUP:
            assert core.take_batch(1, 0) is None
            clock[0] += 0.5
        core.ingest(make_group(f"g{i}", 2))
        assert core.take_batch(1, 0) is not None
    assert core.admission_state().lead == 2
    stats = core.stats()
    assert stats["admission_lead"] == 2 and stats["admission_lead_raised"] == 1


@pytest.mark.parametrize("eta", [0, 1, 2, 3, 5])
def test_no_schedule_of_waits_and_surpluses_takes_the_window_past_the_bound(eta):
    """Random waits and surpluses: 1 <= lead <= eta (eta = 0: 0), the window never wider."""
    import random

    rng = random.Random(eta)
    lead, clock = AdmissionLead(eta, B, "adaptive"), [0.0]
    seen = set()
    for _ in range(2000):
        clock[0] += rng.uniform(0.01, 2.0)
        if rng.random() < 0.5:
            lead.waiting(clock[0])
            clock[0] += rng.uniform(0.0, 3.0)
        lead.handed_out(clock[0], rng.choice([0, 1, B - 1, B, 3 * B]))
        assert (lead.lead == 0) if eta == 0 else (1 <= lead.lead <= eta)
        seen.add(lead.lead)
        rule = StalenessAdmission(eta, B, 100, lead=lead.lead)
        for version in (0, 7):
            assert rule.window_end(version) <= (eta + version + 1) * B
    if eta >= 2:
        assert seen == set(range(1, eta + 1))  # the schedule did move the lead through 1..eta


def test_eta_zero_stays_synchronous_and_the_default_is_the_bound(tmp_path):
    """eta = 0 admits one version at a time whatever the mode; no key set: lead = eta."""
    from buffer.config import BufferConfig
    from buffer.core import BufferCore

    assert BufferConfig().admission_lead == "bound"
    for mode in ("adaptive", "bound"):
        rule = StalenessAdmission(0, B, 100, lead=AdmissionLead(0, B, mode).lead)
        assert rule.window_end(5) == (5 + 1) * B  # only the current version's groups
        assert rule.capacity(5, accepted_groups=5 * B, running_groups=0) == B
        assert rule.capacity(5, accepted_groups=6 * B, running_groups=0) == 0
    core = BufferCore(BufferConfig(max_staleness=2), bank_dir=tmp_path, groups_per_version=4,
                      max_concurrent_groups=16)  # fmt: skip
    state = core.admission_state()
    assert state.lead == 2 and StalenessAdmission.from_state(state).window_end(0) == 3 * 4
