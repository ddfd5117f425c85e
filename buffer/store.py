"""Group-aware replay store: whole groups only, oldest policy first, staleness-checked at hand-out.

A GRPO group (``group_id``, ``group_size`` samples of one prompt) is *complete*
when ``group_size`` distinct samples have arrived; only complete groups are
ever handed out, whole. Hand-out order is by the group's oldest token version,
then by completion: groups finish out of order (long responses take longer),
and a strict completion FIFO would let a younger group overtake an older one
until the older one crosses the staleness bound; oldest-first keeps every
group that is ready in time within η. Per sample:

- a ``uid`` seen before (a producer's resubmission after a buffer restart, a
  retry) is dropped and counted (``duplicates``);
- a sample for a group that is already closed (complete, handed out or
  dropped) is dropped and counted (``group_closed``); one whose ``group_size``
  disagrees with the group's first sample is counted ``group_size_mismatch``.

When a group completes, the optional filters run (each counted):
``filter_truncated`` removes responses cut at the length limit
(``finish_reason == "length"``; the rest of the group is still handed out, with
``group_size`` rewritten to the number of samples handed out, and a group left
empty is dropped), ``filter_equal_scores`` drops groups whose scores are all
equal (DAPO dynamic sampling: zero advantage, no gradient). Samples whose reward
failed (``Trajectory.reward_error``) are no outcome: the filter compares the scored
samples only, and a group with fewer than two of them has zero advantage too. A
group left with no scored sample at all trains nothing and is dropped
(``filtered_reward_failed``; the rollout side sends none such, but the truncation
filter can leave one).

At hand-out a group whose oldest token is older than ``learner_version - η`` is
refused and counted (``refused_stale``): the safety net behind admission pacing.

``accepted_groups`` (the admission counter) = groups completed and kept by the
filters, minus groups refused as stale, minus ``accepted_offset`` (set when the
learner resumes from a checkpoint; see admission.py).

Memory: uids and per-group counts are kept until the owner ``forget``s a group
that can no longer receive samples (retention.py); a group known only as closed
(reloaded from a pruned ledger) is ``register_closed`` with its count.

This module is pure bookkeeping: no sockets, no files, not thread-safe (the
owner serialises calls). Capacity is counted in *complete* groups: partial
groups cannot be the backpressure trigger, or producers blocked at the
high-water mark could never deliver the samples that complete them.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from buffer.wire import Trajectory

FINISH_TRUNCATED = "length"
# What GroupStore counts: accepted and handed-out work, and samples dropped, by reason
REJECTION_REASONS = ("duplicates", "group_closed", "group_size_mismatch")
STORE_COUNTERS = (
    "accepted_samples",
    "completed_groups",
    "handed_out_groups",
    "refused_stale",
    "filtered_truncated_samples",
    "filtered_truncated_groups",
    "filtered_equal_scores",
    "filtered_reward_failed",
    *REJECTION_REASONS,
)


@dataclass
class Group:
    """The samples of one prompt, in arrival order."""

    group_id: str
    group_size: int
    samples: list[Trajectory] = field(default_factory=list)
    completion_seq: int = -1
    _oldest: tuple[int | None] | None = field(default=None, repr=False, compare=False)

    def min_version(self) -> int | None:
        """Oldest policy version of any token in the group (None if no tokens at all).

        Cached once asked: a group is only asked after it is complete and filtered.
        """
        if self._oldest is None:
            versions = [t.min_version() for t in self.samples if len(t.token_versions)]
            self._oldest = (min(versions) if versions else None,)
        return self._oldest[0]

    def is_stale(self, learner_version: int, max_staleness: int) -> bool:
        oldest = self.min_version()
        return oldest is not None and oldest < learner_version - max_staleness


@dataclass(frozen=True)
class GroupClosed:
    """What happened to a group when its last sample arrived."""

    group_id: str
    kept: bool
    reason: str = ""  # "equal_scores" | "truncated" | "reward_failed" when dropped


@dataclass
class TakeResult:
    groups: list[Group]
    refused_stale: list[Group]


class GroupStore:
    def __init__(
        self,
        *,
        max_staleness: int,
        capacity_groups: int,
        filter_equal_scores: bool = False,
        filter_truncated: bool = False,
    ) -> None:
        self.max_staleness = max_staleness
        self.capacity_groups = capacity_groups
        self.filter_equal_scores = filter_equal_scores
        self.filter_truncated = filter_truncated
        # every counter from the start, so a reader never finds one missing
        self.counters: Counter[str] = Counter(dict.fromkeys(STORE_COUNTERS, 0))
        self.accepted_offset = 0
        self._accepted_raw = 0
        self._seen_uids: set[str] = set()
        self._group_uids: dict[str, list[str]] = {}  # to forget a group's uids with it
        self._accepted_per_group: dict[str, int] = {}  # every group not yet forgotten
        self._partial: dict[str, Group] = {}
        self._ready: deque[Group] = deque()

    # ---- ingest ---------------------------------------------------------------------
    def rejection_reason(self, traj: Trajectory) -> str | None:
        """Why ``traj`` would be dropped now (None = acceptable). Does not mutate."""
        if traj.uid in self._seen_uids:
            return "duplicates"
        partial = self._partial.get(traj.group_id)
        if partial is None and traj.group_id in self._accepted_per_group:
            return "group_closed"
        if partial is not None and partial.group_size != traj.group_size:
            return "group_size_mismatch"
        return None

    def add(self, traj: Trajectory, seq: int) -> GroupClosed | None:
        """Accept ``traj`` (caller checked ``rejection_reason``); report its group if now closed."""
        self._seen_uids.add(traj.uid)
        gid = traj.group_id
        self._group_uids.setdefault(gid, []).append(traj.uid)
        self._accepted_per_group[gid] = self._accepted_per_group.get(gid, 0) + 1
        self.counters["accepted_samples"] += 1
        group = self._partial.get(gid)
        if group is None:
            group = self._partial[gid] = Group(gid, traj.group_size)
        group.samples.append(traj)
        if len(group.samples) < group.group_size:
            return None
        del self._partial[gid]
        group.completion_seq = seq
        self.counters["completed_groups"] += 1
        return self._close(group)

    def _close(self, group: Group) -> GroupClosed:
        if self.filter_truncated:
            kept = apply_truncation_filter(group)
            self.counters["filtered_truncated_samples"] += group.group_size - kept
            if kept == 0:
                self.counters["filtered_truncated_groups"] += 1
                return GroupClosed(group.group_id, kept=False, reason="truncated")
        scored = [t.score for t in group.samples if not t.reward_failed]
        if not scored:
            self.counters["filtered_reward_failed"] += 1
            return GroupClosed(group.group_id, kept=False, reason="reward_failed")
        flat = len(scored) < 2 or len(set(scored)) == 1  # zero advantage for every sample
        if self.filter_equal_scores and group.group_size > 1 and flat:
            self.counters["filtered_equal_scores"] += 1
            return GroupClosed(group.group_id, kept=False, reason="equal_scores")
        self._ready.append(group)
        self._accepted_raw += 1
        return GroupClosed(group.group_id, kept=True)

    # ---- hand-out -------------------------------------------------------------------
    def take(self, num_groups: int, learner_version: int) -> TakeResult:
        """Pop exactly ``num_groups`` fresh groups, oldest policy first, refusing stale ones.

        ``groups`` is empty when fewer than ``num_groups`` fresh groups are ready; the
        stale groups met on the way are refused (gone) either way and reported.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        ready = list(self._ready)

        def age(item: tuple[int, Group]) -> tuple[int, int]:
            position, group = item
            oldest = group.min_version()
            return (learner_version if oldest is None else oldest, position)

        taken: list[Group] = []
        refused: list[Group] = []
        for _, group in sorted(enumerate(ready), key=age):
            if len(taken) == num_groups:
                break
            if group.is_stale(learner_version, self.max_staleness):
                refused.append(group)
            else:
                taken.append(group)
        self._count_refused(refused)
        gone = {id(g) for g in refused}
        if len(taken) == num_groups:
            gone |= {id(g) for g in taken}
        else:
            taken = []
        if gone:
            self._ready = deque(g for g in ready if id(g) not in gone)
        if not taken:
            return TakeResult(groups=[], refused_stale=refused)
        self.counters["handed_out_groups"] += len(taken)
        return TakeResult(groups=taken, refused_stale=refused)

    def _count_refused(self, refused: list[Group]) -> None:
        if refused:
            self.counters["refused_stale"] += len(refused)
            self._accepted_raw -= len(refused)

    def requeue_front(self, groups: Iterable[Group]) -> None:
        """Put groups back at the head, keeping their order (a failed send, a rewind)."""
        self._ready.extendleft(reversed(list(groups)))

    # ---- reload / resume ------------------------------------------------------------
    def remove_ready(self, group_ids: set[str]) -> list[Group]:
        """Take the named groups out of the ready queue (reload: already handed out or refused)."""
        removed = [g for g in self._ready if g.group_id in group_ids]
        if removed:
            self._ready = deque(g for g in self._ready if g.group_id not in group_ids)
        return removed

    def forget_refused(self, count: int) -> None:
        """Account ``count`` groups refused as stale in an earlier life of the buffer."""
        self.counters["refused_stale"] += count
        self._accepted_raw -= count

    def reset_accepted_for_resume(self, consumed_groups: int) -> int:
        """``accepted_groups := groups consumed up to the checkpoint + ready groups``.

        ``consumed_groups`` is the checkpoint's hand-out watermark: ``v * B`` when the
        checkpoint fell on a version boundary, more when it fell between two (with
        ``sync_every > 1``); using ``v * B`` there would admit up to a version too many.
        Returns the new offset.
        """
        target = consumed_groups + len(self._ready)
        self.accepted_offset = self._accepted_raw - target
        return self.accepted_offset

    def restore_accepted_base(self, groups: int) -> None:
        """Admission groups counted by groups no longer read back (a pruned bank)."""
        self._accepted_raw += groups

    def register_closed(self, group_id: str, accepted: int) -> None:
        """Know ``group_id`` as closed with ``accepted`` samples (its samples are not loaded)."""
        self._accepted_per_group[group_id] = accepted

    def forget(self, group_id: str) -> None:
        """Drop every trace of a group that can receive no more samples (retention.py)."""
        self._accepted_per_group.pop(group_id, None)
        for uid in self._group_uids.pop(group_id, ()):
            self._seen_uids.discard(uid)

    def sizes(self) -> dict[str, int]:
        """Entries held per map (the soak watches these stay bounded)."""
        return {
            "store_known_uids": len(self._seen_uids),
            "store_known_groups": len(self._accepted_per_group),
        }

    # ---- views ----------------------------------------------------------------------
    @property
    def accepted_groups(self) -> int:
        return self._accepted_raw - self.accepted_offset

    @property
    def accepted_raw(self) -> int:
        """Groups completed and kept, minus refused; before the resume offset."""
        return self._accepted_raw

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def ready_samples(self) -> int:
        return sum(len(g.samples) for g in self._ready)

    @property
    def partial_groups(self) -> int:
        return len(self._partial)

    @property
    def is_full(self) -> bool:
        return len(self._ready) >= self.capacity_groups

    def accepted_count(self, group_id: str) -> int:
        return self._accepted_per_group.get(group_id, 0)


def apply_truncation_filter(group: Group) -> int:
    """Drop truncated samples from ``group`` in place; rewrite group_size; return samples kept."""
    kept = [t for t in group.samples if t.finish_reason != FINISH_TRUNCATED]
    if len(kept) != len(group.samples):
        kept = [msgspec.structs.replace(t, group_size=len(kept)) for t in kept]
    group.samples = kept
    return len(kept)


def screen(store: GroupStore, trajs: Iterable[Trajectory]) -> tuple[list[Trajectory], Counter[str]]:
    """Split an ingest batch into acceptable samples and rejection counts, without mutating.

    Checks each sample against the store *and* the samples before it in the same batch
    (a duplicate uid, or a sample past a group that this batch completes).
    """
    accepted: list[Trajectory] = []
    rejected: Counter[str] = Counter()
    batch_uids: set[str] = set()
    batch_counts: Counter[str] = Counter()
    batch_sizes: dict[str, int] = {}
    for traj in trajs:
        reason = store.rejection_reason(traj)
        gid = traj.group_id
        if reason is None and traj.uid in batch_uids:
            reason = "duplicates"
        if reason is None and gid in batch_sizes:
            if traj.group_size != batch_sizes[gid]:
                reason = "group_size_mismatch"
            elif store.accepted_count(gid) + batch_counts[gid] >= traj.group_size:
                reason = "group_closed"
        if reason is not None:
            rejected[reason] += 1
            continue
        batch_uids.add(traj.uid)
        batch_counts[gid] += 1
        batch_sizes.setdefault(gid, traj.group_size)
        accepted.append(traj)
    return accepted, rejected


def rebuild_group(samples: list[Trajectory], *, filter_truncated: bool) -> Group:
    """A handed-out group read back from the bank, shaped as it was handed out."""
    group = Group(samples[0].group_id, samples[0].group_size, list(samples))
    if filter_truncated:
        apply_truncation_filter(group)
    return group
