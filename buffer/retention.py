"""What the buffer may forget: bounded maps and pruned bank segments, exactly-once kept.

Without pruning the buffer remembers every uid (dedupe), every group's accepted
count, every hand-out and every bank segment for the life of the run. This
module decides, at each ``Commit``, which groups are *final* and which of them
can be *forgotten*, and which closed segments can be deleted. ``BufferCore``
applies the plan (core.py); the bank rewrites its ledger and deletes the
segments (bank.py).

Definitions, per group:

- *final*: it will never be served again and never again counted. A group
  handed out below the committed watermark is final at that commit. A group
  refused as stale or dropped by a filter becomes final at the *second* commit
  after it was refused or dropped (one commit of lag, see below).
- *releasable*: final, and not in the commit's ``retain`` list.
- a closed segment is *deletable* when every group with a sample in it is
  releasable; a releasable group is *forgotten* (uids, accepted count, first
  segment, hand-out entry) once none of its segments is left on disk.

Final groups not yet forgotten are remembered as closed (a late sample of one
is dropped as ``group_closed``, ``QueryGroups`` still reports its count) and are
listed in the ledger's ``Snapshot`` so that a reload skips their samples.
Memory and disk are therefore bounded by the groups in flight (partial, ready,
handed out but not committed), the groups sharing a segment with them, and the
retain list: not by the length of the run.

Why forgetting loses nothing and duplicates nothing. A forgotten group's uids
are no longer recognised, so the argument is that no sample of it can arrive
again. Samples are sent again in two ways only (rollout_fleet/delivery.py):

1. after a buffer restart, the delivery ledger re-sends the groups it still
   holds (not yet seen whole by ``QueryGroups``);
2. after a resume from checkpoint C, the prompts C lists as unfinished are
   generated again with the same group ids (new prompts have new ids).

The driver sends, with each commit of watermark W, ``retain`` = the unfinished
prompts of every checkpoint it may still resume from (those whose watermark is
at least W; older ones are refused by the buffer anyway). That covers (2). For
(1): the delivery ledger holds a group from its first prompt until it sees it
whole; a group held when checkpoint C_k took its snapshot of unfinished prompts
is in C_k's list, so it is retained at the commit made with C_k. A pruned group
G became final *before* that snapshot (a hand-out below W_{k-1} happened before
C_{k-1} was written; a refusal or drop is final only one commit later, i.e.
before C_{k-1}'s commit), so if the ledger did not hold G at the snapshot it
had already seen G whole, and it never holds G again (it only takes new prompts
or the retained ones of a resumed checkpoint). Producers other than the fleet
(the synthetic ones of tests and bench) never re-send; they pass no retain list.

The rollout worker's ``_in_transit`` map forgets a sent group once
``QueryGroups`` counts it whole; it polls at every admission round, which is
orders of magnitude shorter than the checkpoint interval after which the group
could be forgotten here.

Left out: groups of a producer that re-sends without a checkpoint to name them
(pass ``prune_committed: false`` for those).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class PrunePlan:
    """What one commit lets go: segments to delete, groups to forget."""

    delete_segments: list[int] = field(default_factory=list)
    forget_groups: list[str] = field(default_factory=list)


class Retention:
    """Which groups live in which segments, and which are final. Pure bookkeeping."""

    def __init__(self) -> None:
        self.segment_groups: dict[int, set[str]] = {}
        self.group_segments: dict[str, set[int]] = {}
        self.final: set[str] = set()
        self.retain: set[str] = set()
        self._done_recent: set[str] = set()  # refused/dropped since the last commit
        self._done_lagged: set[str] = set()  # refused/dropped before the last commit

    def note_samples(self, segment: int, group_ids: Iterable[str]) -> None:
        """Samples of ``group_ids`` were written to (or read back from) ``segment``."""
        groups = self.segment_groups.setdefault(segment, set())
        for gid in group_ids:
            groups.add(gid)
            self.group_segments.setdefault(gid, set()).add(segment)

    def note_done(self, group_ids: Iterable[str]) -> None:
        """Groups refused as stale or dropped by a filter: final after the next commit."""
        self._done_recent.update(group_ids)

    def note_final(self, group_ids: Iterable[str]) -> None:
        """Groups already final (reload: listed in the snapshot or committed in the ledger)."""
        self.final.update(group_ids)

    @property
    def refused_or_dropped_pending(self) -> set[str]:
        return self._done_recent | self._done_lagged

    def plan(
        self, committed_groups: Iterable[str], retain: Iterable[str], closed_below: int
    ) -> PrunePlan:
        """A commit: ``committed_groups`` are newly committed; segments < ``closed_below``
        are closed. Returns what may go; the caller applies it, then calls ``forget``."""
        self.final.update(committed_groups)
        self.final |= self._done_lagged
        self._done_lagged, self._done_recent = self._done_recent, set()
        self.retain = set(retain)
        releasable = self.final - self.retain
        delete = sorted(
            s
            for s, groups in self.segment_groups.items()
            if s < closed_below and groups <= releasable
        )
        gone = set(delete)
        forget = sorted(g for g in releasable if self.group_segments.get(g, set()) <= gone)
        return PrunePlan(delete, forget)

    def forget(self, plan: PrunePlan) -> None:
        for segment in plan.delete_segments:
            self.segment_groups.pop(segment, None)
        for gid in plan.forget_groups:
            self.final.discard(gid)
            self.group_segments.pop(gid, None)

    def sizes(self) -> dict[str, int]:
        return {
            "retention_final_groups": len(self.final),
            "retention_retained_groups": len(self.retain & self.final),
            "retention_tracked_groups": len(self.group_segments),
            "retention_segments": len(self.segment_groups),
        }
