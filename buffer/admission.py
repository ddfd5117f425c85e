"""Staleness-bounded admission: how many new groups the rollout fleet may start now.

The rule (AReaL, arXiv 2505.24298; DESIGN §2). The learner consumes
``B = groups_per_version`` groups per policy version and is now at version ``v``.
A group started now is queued behind every group already accepted by the buffer
or still being generated, so it is trained on no later than version
``(accepted + running) // B``. Requiring

    accepted + running < (max_staleness + v + 1) * B

keeps that at most ``max_staleness`` (η) versions ahead of the policy that
starts generating it, i.e. its staleness when trained on is at most η. On top
of that, never more than ``max_concurrent`` groups are in flight. With a lead
(``buffer.lead``: the fewest versions ahead that keep the learner fed) the window
uses it in place of η; it never exceeds η.

Why pace admission instead of dropping finished work: a generator that runs
ahead and lets the buffer throw away whatever is too old wastes the compute of
every dropped sample, and it drops *selectively* - long responses (hard
prompts, long reasoning) take longest, so they are the ones that arrive stale.
Dropping therefore biases the training distribution toward short, easy
samples. Pacing makes staleness a property of *when generation starts*, so
every finished sample is usable and the data stays unbiased. The buffer's
hand-out check (``store.py``, counter ``refused_stale``) remains as a safety net
that should count zero in a healthy run.

``accepted`` counts every group the buffer accepted since the start of the run
and that is (or will be) trained on: groups dropped by a filter or refused as
stale are not counted, or generation would stall waiting for versions that
never come. Resume from a checkpoint at version ``v`` (the known peer bug: the
bound silently breaks after recovery when ``accepted`` is restored as it was at
the crash, or restarts from zero): ``accepted`` must restart at the groups
consumed up to the checkpoint (its hand-out watermark, ``v * B`` on a version
boundary) plus the groups the buffer still holds for training
(``GroupStore.reset_accepted_for_resume``). Anything
generated after the checkpoint and lost does not count.

One source of truth: B is derived from the run config once (``derive_groups_per_version``)
and handed to the buffer, which builds the rule (``BufferCore``) and reports all
of its inputs with every ``AdmissionState``; the rollout worker applies the rule
to the state it polled (``StalenessAdmission.from_state``) rather than deriving
B and η again from its own copy of the config.

Left out: per-sample (rather than per-group) accounting; partial groups count
as running on the producer side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


def derive_groups_per_version(train_batch_size: int, sync_every: int) -> int:
    """B: groups the learner consumes per published version (a batch per step, a version
    every ``sync_every`` steps)."""
    return train_batch_size * sync_every


class AdmissionInputs(Protocol):
    """What the buffer reports (``buffer.wire.AdmissionState``): the rule's inputs."""

    max_staleness: int
    groups_per_version: int
    max_concurrent: int
    # and ``lead`` (AdmissionState's, -1 when none): read with getattr, older peers lack it


@dataclass(frozen=True)
class StalenessAdmission:
    """Pure arithmetic of the admission rule; the counters come from the buffer.

    ``lead`` (``buffer.lead``): generate at most this many versions ahead (never more
    than ``max_staleness``); None: as far as ``max_staleness`` allows.
    """

    max_staleness: int
    groups_per_version: int
    max_concurrent: int
    lead: int | None = None

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.groups_per_version < 1:
            raise ValueError(f"groups_per_version must be >= 1, got {self.groups_per_version}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")

    @classmethod
    def from_state(cls, state: AdmissionInputs) -> StalenessAdmission:
        """The buffer's rule, from the inputs it reported (a producer's view of it)."""
        lead = getattr(state, "lead", -1)
        return cls(
            state.max_staleness,
            state.groups_per_version,
            state.max_concurrent,
            lead if lead >= 0 else None,
        )

    @property
    def ahead(self) -> int:
        """Versions ahead of the learner generation may start: the lead, within the bound."""
        return self.max_staleness if self.lead is None else min(self.lead, self.max_staleness)

    def window_end(self, policy_version: int) -> int:
        """Total groups (accepted + running) allowed while the learner is at ``policy_version``."""
        return (self.ahead + policy_version + 1) * self.groups_per_version

    def capacity(self, policy_version: int, accepted_groups: int, running_groups: int) -> int:
        """How many more groups may start generating now (>= 0)."""
        if policy_version < 0 or accepted_groups < 0 or running_groups < 0:
            raise ValueError(
                "admission counters must be >= 0: "
                f"policy_version={policy_version} accepted={accepted_groups} running={running_groups}"
            )
        by_staleness = self.window_end(policy_version) - accepted_groups - running_groups
        by_concurrency = self.max_concurrent - running_groups
        return max(0, min(by_staleness, by_concurrency))
