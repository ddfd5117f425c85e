"""The AReaL admission rule, its concurrency cap, and the accepted-counter reset on resume."""

from __future__ import annotations

import pytest

from buffer.admission import StalenessAdmission


def test_capacity_follows_the_staleness_window():
    adm = StalenessAdmission(max_staleness=1, groups_per_version=4, max_concurrent=100)
    # window at v=0 is (1+0+1)*4 = 8 groups in total
    assert adm.capacity(policy_version=0, accepted_groups=0, running_groups=0) == 8
    assert adm.capacity(policy_version=0, accepted_groups=5, running_groups=2) == 1
    assert adm.capacity(policy_version=0, accepted_groups=6, running_groups=2) == 0
    assert adm.capacity(policy_version=1, accepted_groups=6, running_groups=2) == 4


def test_capacity_never_exceeds_the_concurrency_cap():
    adm = StalenessAdmission(max_staleness=8, groups_per_version=16, max_concurrent=5)
    assert adm.capacity(0, 0, 0) == 5
    assert adm.capacity(0, 0, 4) == 1
    assert adm.capacity(0, 0, 7) == 0


def test_synchronous_eta_zero_admits_exactly_one_version():
    adm = StalenessAdmission(max_staleness=0, groups_per_version=3, max_concurrent=100)
    assert adm.capacity(0, 0, 0) == 3
    assert adm.capacity(0, 3, 0) == 0  # must wait for the learner to publish version 1
    assert adm.capacity(1, 3, 0) == 3


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_any_group_admitted_is_trained_within_eta_versions(eta):
    """Simulate: admit greedily, consume B groups per version FIFO; staleness never exceeds η."""
    b = 4
    adm = StalenessAdmission(max_staleness=eta, groups_per_version=b, max_concurrent=1000)
    started_at: list[int] = []  # policy version that started each group, in acceptance order
    version = 0
    consumed = 0
    for _ in range(50):
        for _ in range(adm.capacity(version, len(started_at), 0)):
            started_at.append(version)
        # learner consumes one version's worth (if available) and publishes the next
        if len(started_at) - consumed >= b:
            for gv in started_at[consumed : consumed + b]:
                assert version - gv <= eta
            consumed += b
            version += 1
    assert version > 10


def test_resume_resets_accepted_to_consumed_plus_waiting():
    """The peer bug: after resume at v, accepted must be v*B (+ what the buffer still holds)."""
    adm = StalenessAdmission(max_staleness=1, groups_per_version=4, max_concurrent=100)
    # crashed at version 7 having accepted 40 groups; checkpoint was at version 5
    stale_counter = 40
    assert adm.capacity(5, stale_counter, 0) == 0  # keeping the old counter: generation stalls
    assert adm.capacity(5, 0, 0) == 28  # restarting from zero: 28 > window, bound broken
    accepted = 5 * 4  # consumed up to the checkpoint (its watermark), nothing waiting
    assert adm.capacity(5, accepted, 0) == 8  # exactly η+1 versions' worth, as in a fresh run


def test_bad_arguments_are_refused_with_names():
    with pytest.raises(ValueError, match="groups_per_version"):
        StalenessAdmission(max_staleness=1, groups_per_version=0, max_concurrent=1)
    adm = StalenessAdmission(1, 1, 1)
    with pytest.raises(ValueError, match="running=-1"):
        adm.capacity(0, 0, -1)


def test_a_producer_applies_the_rule_the_buffer_reports():
    from buffer.wire import AdmissionState

    state = AdmissionState(
        policy_version=2, accepted_groups=9, max_staleness=1, groups_per_version=4, max_concurrent=3
    )
    rule = StalenessAdmission.from_state(state)
    assert rule == StalenessAdmission(max_staleness=1, groups_per_version=4, max_concurrent=3)
    assert rule.capacity(state.policy_version, state.accepted_groups, running_groups=1) == 2
