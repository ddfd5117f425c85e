"""The buffer's logic without sockets: ingest, hand-out, watermarks, admission counters.

``BufferCore`` ties the group store (store.py), the durable bank (bank.py) and
the admission rule (admission.py) together and is shared by the ZeroMQ service
(service.py) and the in-process transport (transport.py). Every public method
takes the one lock, so any thread may call it; ``wait_ready`` lets in-process
consumers long-poll on the same condition.

Hand-out order and watermarks. Groups leave the buffer numbered 0, 1, 2, ...
(the hand-out index). Before a batch is returned its hand-out is written to the
ledger. Three numbers then describe the consumer side:

- ``handout_count``: hand-outs made (ledger);
- the consumer's *received watermark* (sent with every ``GetBatch``): hand-outs
  it actually got. If it is behind ``handout_count`` the difference was lost
  (a reply lost in a buffer crash, or the learner resumed from a checkpoint) and
  those groups are read back from the bank and served again first, in their
  original order (``rewind``);
- ``committed``: hand-outs trained on and checkpointed (``Commit``); never
  served again, and a rewind below it is refused.

Reload after a crash replays bank + ledger: every accepted sample comes back
(uid-deduplicated), complete groups not handed out are ready again in
completion order, partial groups wait for the fleet's resubmissions, and the
admission counter is exactly what it was.

Bounded over long runs (``prune_committed``). Each commit trims the hand-out
list below the watermark, and retention.py decides which groups are final and
which closed segments no longer hold anything needed: those segments are
deleted after the ledger is rewritten as a ``Snapshot`` (bank.py), and their
groups' uids and counts are forgotten. retention.py's docstring gives the
argument that nothing is lost or served twice. ``bank_max_bytes`` bounds the
bank on disk by backpressure: while it is exceeded and a batch's worth of groups
is ready, ingest pauses (producers block, nothing is dropped) until a commit
prunes; with fewer groups ready ingest continues, so the learner can always
reach the checkpoint that frees space (the bound is then exceeded, and counted).

Left out: several independent consumers (one learner process fetches the
global batch and scatters it to its ranks, as verl and AReaL do).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

from buffer.admission import StalenessAdmission
from buffer.arrow_batch import to_ipc, trajectories_to_arrow
from buffer.bank import (
    CommitMark,
    Dropped,
    Handout,
    Refused,
    ResumeMark,
    Rewind,
    RolloutBank,
    Snapshot,
    VersionMark,
)
from buffer.config import BufferConfig
from buffer.lead import AdmissionLead
from buffer.retention import Retention
from buffer.store import Group, GroupStore, rebuild_group, screen
from buffer.wire import (
    KIND_TRAJECTORY,
    AdmissionState,
    Batch,
    FrameError,
    Trajectory,
    WireError,
    check_header,
    decode_trajectory,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

COUNTERS = (
    "received_messages",
    "bank_write_errors",
    "rewound_groups",
    "forgotten_groups",
    "bank_over_bound",
    "reload_skipped_closed",
    "reload_duplicates",
    "undeliverable_replies",
)

MAX_GROUP_SIZE = 4096
REJECT_LOG_FIRST = 10  # rejected frames logged individually per reason, then every Nth
REJECT_LOG_EVERY = 1000
MAX_ID_CHARS = 512
_INT_DTYPES = {"int32", "int64"}
_FLOAT_DTYPES = {"float32", "float16"}


class BufferStateError(ValueError):
    """A request inconsistent with the buffer's durable state (e.g. rewind below commit)."""


def check_trajectory(traj: Trajectory) -> None:
    """Buffer-side checks beyond ``Trajectory.validate``: dtypes, sizes, identifiers."""
    traj.validate()
    for name, allowed in (
        ("prompt_ids", _INT_DTYPES),
        ("response_ids", _INT_DTYPES),
        ("token_versions", _INT_DTYPES),
        ("behavior_logprobs", _FLOAT_DTYPES),
    ):
        dtype = getattr(traj, name).dtype
        if dtype not in allowed:
            raise WireError(f"trajectory {traj.uid!r}: {name} dtype {dtype} not in {allowed}")
    if not traj.uid or not traj.group_id:
        raise WireError("trajectory with an empty uid or group_id")
    if len(traj.uid) > MAX_ID_CHARS or len(traj.group_id) > MAX_ID_CHARS:
        raise WireError(f"trajectory uid/group_id longer than {MAX_ID_CHARS} characters")
    if traj.group_size > MAX_GROUP_SIZE:
        raise WireError(f"trajectory {traj.uid!r}: group_size {traj.group_size} > {MAX_GROUP_SIZE}")


class BufferCore:
    def __init__(
        self,
        config: BufferConfig,
        *,
        bank_dir: str | Path,
        groups_per_version: int,
        max_concurrent_groups: int,
    ) -> None:
        self.config = config
        self.admission = StalenessAdmission(
            config.max_staleness, groups_per_version, max_concurrent_groups
        )
        # how far ahead the fleet may generate now: the fewest versions that keep the
        # learner fed, within the bound (buffer/lead.py)
        self.lead = AdmissionLead(config.max_staleness, groups_per_version, config.admission_lead)
        self.store = GroupStore(
            max_staleness=config.max_staleness,
            capacity_groups=config.capacity_groups,
            filter_equal_scores=config.filter_equal_scores,
            filter_truncated=config.filter_truncated,
        )
        self.bank = RolloutBank(
            bank_dir,
            segment_rows=config.segment_rows,
            fsync_every_write=config.fsync_every_write,
        )
        # every counter is reported from the start (0 until it moves), so readers of
        # stats() never meet a missing key before the first message arrives
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.rejected: Counter[str] = Counter()
        self.policy_version = 0
        self.committed = 0
        self._handed: list[str] = []  # group id at each hand-out index from _handed_base
        self._handed_base = 0  # hand-outs below it are committed: never served again
        self._first_segment: dict[str, int] = {}
        self.retention = Retention()
        self.pruned_segments = 0
        self._over_disk_bound = False
        self._seq = 0
        self.ready = threading.Condition()
        self._reload()

    # ---- ingest ---------------------------------------------------------------------
    def ingest_messages(self, messages: list[list[bytes]]) -> int:
        """Decode ``[header, payload]`` messages, count and drop bad ones, ingest the rest."""
        trajs: list[Trajectory] = []
        with self.ready:
            self.counters["received_messages"] += len(messages)
        for frames in messages:
            try:
                trajs.append(self._decode(frames))
            except FrameError as err:
                self.reject(err.reason, str(err))
            except WireError as err:
                self.reject("invalid", str(err))
        return self.ingest(trajs)

    def _decode(self, frames: list[bytes]) -> Trajectory:
        size = sum(len(f) for f in frames)
        if size > self.config.max_message_bytes:
            raise FrameError("oversized", f"{size} bytes > {self.config.max_message_bytes}")
        if len(frames) != 2:
            raise FrameError("frame_count", f"trajectory message has {len(frames)} frames, not 2")
        check_header(frames[0], KIND_TRAJECTORY)
        try:
            traj = decode_trajectory(frames[1])
        except WireError as err:
            raise FrameError("malformed", str(err)) from None
        check_trajectory(traj)
        return traj

    def reject(self, reason: str, detail: str) -> None:
        with self.ready:
            self.rejected[reason] += 1
            count = self.rejected[reason]
        if count <= REJECT_LOG_FIRST or count % REJECT_LOG_EVERY == 0:  # a flood stays readable
            log.warning("rejected frame #%d (%s): %s", count, reason, detail[:300])

    def ingest(self, trajs: list[Trajectory]) -> int:
        """Accept what is acceptable: bank it (flushed), then count it. Returns samples accepted."""
        with self.ready:
            accepted, rejected = screen(self.store, trajs)
            self.store.counters.update(rejected)
            if not accepted:
                return 0
            try:
                segment = self.bank.append(accepted)
            except OSError as err:  # not acknowledged: the fleet resubmits
                self.counters["bank_write_errors"] += 1
                log.error("bank write of %d samples failed: %s", len(accepted), err)
                return 0
            self.retention.note_samples(segment, {t.group_id for t in accepted})
            dropped: dict[str, list[str]] = {}
            new_ready = False
            for traj in accepted:
                self._first_segment.setdefault(traj.group_id, segment)
                closed = self.store.add(traj, self._seq)
                self._seq += 1
                if closed is not None:
                    if closed.kept:
                        new_ready = True
                    else:
                        dropped.setdefault(closed.reason, []).append(closed.group_id)
            for reason, groups in dropped.items():
                self.bank.record(Dropped(groups, reason))
                self.retention.note_done(groups)
            if new_ready:
                self.ready.notify_all()
            return len(accepted)

    # ---- hand-out -------------------------------------------------------------------
    def take_batch(
        self, num_groups: int, learner_version: int, received_watermark: int = -1
    ) -> tuple[Batch, list[Group]] | None:
        """Exactly ``num_groups`` whole groups as an Arrow batch, or None if not enough yet."""
        with self.ready:
            if received_watermark >= 0 and received_watermark != self.handout_count:
                self._rewind(received_watermark)
            if self.store.ready_groups < num_groups:
                self.lead.waiting(time.monotonic())
                return None
            result = self.store.take(num_groups, learner_version)
            if result.refused_stale:
                ids = [g.group_id for g in result.refused_stale]
                self.bank.record(Refused(ids, learner_version))
                self.retention.note_done(ids)
                log.warning(
                    "refused %d stale groups at learner version %d (max_staleness %d): %s",
                    len(ids),
                    learner_version,
                    self.config.max_staleness,
                    ids[:8],
                )
            if not result.groups:
                return None
            self.ready.notify_all()  # room for producers blocked on a full buffer
            self.lead.handed_out(time.monotonic(), self.store.ready_groups)
            ids = [g.group_id for g in result.groups]
            start = self.handout_count
            self.bank.record(Handout(start, ids, learner_version))
            self._handed.extend(ids)
            samples = [t for g in result.groups for t in g.samples]
            batch = Batch(
                arrow_ipc=to_ipc(trajectories_to_arrow(samples)),
                num_groups=len(ids),
                num_samples=len(samples),
                handout_start=start,
                learner_version=learner_version,
                refused_stale=len(result.refused_stale),
            )
            return batch, result.groups

    def return_unsent(self, batch: Batch, groups: list[Group]) -> None:
        """The batch could not be sent: undo its hand-out (it goes back to the head)."""
        with self.ready:
            if batch.handout_start + batch.num_groups != self.handout_count:
                raise BufferStateError("return_unsent: another hand-out happened after this one")
            del self._handed[batch.handout_start - self._handed_base :]
            self.store.requeue_front(groups)
            self.store.counters["handed_out_groups"] -= len(groups)
            self.bank.record(Rewind(batch.handout_start))
            self.ready.notify_all()

    def _rewind(self, watermark: int) -> None:
        if watermark > self.handout_count:
            raise BufferStateError(
                f"consumer watermark {watermark} is ahead of the buffer's {self.handout_count} "
                "hand-outs: this bank is not the one that served it"
            )
        if watermark < self.committed:
            raise BufferStateError(
                f"cannot serve again from hand-out {watermark}: hand-outs below "
                f"{self.committed} are committed (trained on and checkpointed)"
            )
        ids = self._handed[watermark - self._handed_base :]
        from_segment = min(self._first_segment.get(g, 0) for g in ids)
        stored = self.bank.read_groups(set(ids), from_segment)
        groups = []
        for gid in ids:
            samples = stored.get(gid) or []
            if len(samples) < (samples[0].group_size if samples else 1):
                raise BufferStateError(f"group {gid!r} handed out but incomplete in the bank")
            groups.append(rebuild_group(samples, filter_truncated=self.config.filter_truncated))
        del self._handed[watermark - self._handed_base :]
        self.store.requeue_front(groups)
        self.counters["rewound_groups"] += len(groups)
        self.bank.record(Rewind(watermark), sync=True)
        log.info("serving again %d hand-outs from index %d", len(groups), watermark)
        self.ready.notify_all()

    def wait_ready(self, num_groups: int, timeout_s: float) -> bool:
        """Block until ``num_groups`` groups are ready or ``timeout_s`` passes (in-process)."""
        with self.ready:
            return self.ready.wait_for(lambda: self.store.ready_groups >= num_groups, timeout_s)

    # ---- control --------------------------------------------------------------------
    def publish_version(self, version: int) -> None:
        with self.ready:
            if version < self.policy_version:
                raise BufferStateError(
                    f"policy version went back from {self.policy_version} to {version}; "
                    "a learner resuming from a checkpoint sends Resume"
                )
            if version != self.policy_version:
                self.policy_version = version
                self.bank.record(VersionMark(version))

    def commit(self, watermark: int, retain_groups: list[str] | None = None) -> None:
        """Hand-outs below ``watermark`` are checkpointed; prune what that makes final.

        ``retain_groups``: groups a producer may still send again (wire.Commit).
        """
        retain = sorted(set(retain_groups or ()))
        with self.ready:
            if watermark > self.handout_count:
                raise BufferStateError(
                    f"commit watermark {watermark} > hand-outs made ({self.handout_count})"
                )
            newly: list[str] = []
            if watermark > self.committed:
                newly = self._handed[
                    self.committed - self._handed_base : watermark - self._handed_base
                ]
                self.committed = watermark
            elif set(retain) == self.retention.retain:
                return
            del self._handed[: self.committed - self._handed_base]
            self._handed_base = self.committed
            if not self.config.prune_committed:
                self.bank.record(CommitMark(self.committed, retain), sync=True)
                return
            plan = self.retention.plan(newly, retain, closed_below=self.bank.current_segment)
            if plan.delete_segments:
                self.pruned_segments += len(plan.delete_segments)
                self.bank.rewrite_ledger(self._snapshot(retain))  # before deleting: crash-safe
                self.bank.delete_segments(plan.delete_segments)
            else:
                self.bank.record(CommitMark(self.committed, retain), sync=True)
            for gid in plan.forget_groups:
                self.store.forget(gid)
                self._first_segment.pop(gid, None)
            self.retention.forget(plan)
            self.counters["forgotten_groups"] += len(plan.forget_groups)
            self.ready.notify_all()  # a producer waiting on the disk bound may go on

    def _snapshot(self, retain: list[str]) -> list:
        """The pruned ledger: a Snapshot, then the records reload still needs (see bank.py)."""
        on_disk_live = self.store.ready_groups + len(self._handed)  # +1 each in accepted_raw
        records: list = [
            Snapshot(
                handout_base=self._handed_base,
                committed=self.committed,
                version=self.policy_version,
                accepted_base=self.store.accepted_raw - on_disk_live,
                accepted_offset=self.store.accepted_offset,
                closed={g: self.store.accepted_count(g) for g in sorted(self.retention.final)},
                retain=retain,
                pruned_segments=self.pruned_segments,
            )
        ]
        if self._handed:
            records.append(Handout(self._handed_base, list(self._handed), self.policy_version))
        pending = sorted(self.retention.refused_or_dropped_pending)
        if pending:  # reload removes them from the ready queue (dropped ones never get there)
            records.append(Refused(pending, self.policy_version))
        return records

    def resume(self, version: int, watermark: int) -> int:
        """Learner resumed from a checkpoint: re-serve from ``watermark``, reset admission."""
        with self.ready:
            if watermark != self.handout_count:
                self._rewind(watermark)
            self.policy_version = version
            offset = self.store.reset_accepted_for_resume(watermark)
            self.bank.record(ResumeMark(version, watermark, offset), sync=True)
            log.info(
                "learner resumed at version %d, watermark %d: accepted_groups := %d",
                version,
                watermark,
                self.store.accepted_groups,
            )
            return self.store.accepted_groups

    def admission_state(self) -> AdmissionState:
        with self.ready:
            return AdmissionState(
                policy_version=self.policy_version,
                accepted_groups=self.store.accepted_groups,
                max_staleness=self.admission.max_staleness,
                groups_per_version=self.admission.groups_per_version,
                max_concurrent=self.admission.max_concurrent,
                lead=self.lead.lead,
            )

    def group_status(self, group_ids: list[str]) -> list[int]:
        with self.ready:
            return [self.store.accepted_count(g) for g in group_ids]

    def stats(self) -> dict[str, int | float]:
        with self.ready:
            out: dict[str, int | float] = dict(self.counters)
            out.update(self.store.counters)
            for reason, n in self.rejected.items():
                out[f"rejected_frames.{reason}"] = n
            out["rejected_frames"] = sum(self.rejected.values())
            out["admission_lead"] = self.lead.lead
            out["admission_lead_raised"] = self.lead.raised
            out["admission_lead_lowered"] = self.lead.lowered
            out.update(
                accepted_groups=self.store.accepted_groups,
                ready_groups=self.store.ready_groups,
                ready_samples=self.store.ready_samples,
                partial_groups=self.store.partial_groups,
                handout_count=self.handout_count,
                committed_watermark=self.committed,
                policy_version=self.policy_version,
                full=int(self.is_full),
                bank_segment=self.bank.current_segment,
                bank_segments=self.bank.num_segments,
                bank_disk_bytes=self.bank.disk_bytes,
                pruned_segments=self.pruned_segments,
                tracked_handouts=len(self._handed),
                tracked_first_segments=len(self._first_segment),
            )
            out.update(self.store.sizes())
            out.update(self.retention.sizes())
            return out

    @property
    def handout_count(self) -> int:
        return self._handed_base + len(self._handed)

    @property
    def is_full(self) -> bool:
        """Producers must wait: capacity reached, or the bank over ``bank_max_bytes`` while
        a batch's worth of groups is ready (so the learner can still reach a checkpoint)."""
        with self.ready:  # re-entrant: stats() and in-process waiters already hold it
            if self.store.is_full:
                return True
            limit = self.config.bank_max_bytes
            over = bool(limit) and self.bank.disk_bytes >= limit
            if over != self._over_disk_bound:
                self._over_disk_bound = over
                if over:
                    self.counters["bank_over_bound"] += 1
                    log.warning(
                        "rollout bank holds %d bytes >= bank_max_bytes %d: ingest waits for a "
                        "commit to prune (while %d groups are ready)",
                        self.bank.disk_bytes,
                        limit,
                        self.admission.groups_per_version,
                    )
            return over and self.store.ready_groups >= self.admission.groups_per_version

    def close(self) -> None:
        with self.ready:
            self.bank.close()

    # ---- reload ---------------------------------------------------------------------
    def _reload(self) -> None:
        """Replay ledger and bank: the state every acknowledged sample and record implies."""
        records = self.bank.read_ledger()
        base, handed, refused, offset, accepted_base, closed, retain = self._replay(records)
        reloaded = 0
        done: list[str] = []
        for segment, trajs in self.bank.iter_trajectories():
            self.retention.note_samples(segment, {t.group_id for t in trajs})
            for traj in trajs:
                if traj.group_id in closed:  # final before a prune: not needed again
                    self.counters["reload_skipped_closed"] += 1
                    continue
                if self.store.rejection_reason(traj) is not None:
                    self.counters["reload_duplicates"] += 1
                    continue
                self._first_segment.setdefault(traj.group_id, segment)
                closed_now = self.store.add(traj, self._seq)
                if closed_now is not None and not closed_now.kept:
                    done.append(closed_now.group_id)
                self._seq += 1
                reloaded += 1
        for gid, count in closed.items():
            self.store.register_closed(gid, count)
        self.store.remove_ready(set(handed))
        self.store.forget_refused(len(self.store.remove_ready(refused)))
        self.store.restore_accepted_base(accepted_base)
        self.store.accepted_offset = offset
        committed_here = handed[: self.committed - base]
        self.retention.note_final([*closed, *committed_here])
        self.retention.note_done([*refused, *done])  # one more commit of lag: safe
        self.retention.retain = set(retain)
        self._handed = handed[self.committed - base :]
        self._handed_base = self.committed
        self.store.counters["handed_out_groups"] = self.handout_count
        if reloaded or records:
            log.info(
                "reloaded bank %s: %d samples, %d ready groups, %d partial, %d hand-outs "
                "(committed %d), policy version %d, %d groups known closed",
                self.bank.dir,
                reloaded,
                self.store.ready_groups,
                self.store.partial_groups,
                self.handout_count,
                self.committed,
                self.policy_version,
                len(closed),
            )

    def _replay(
        self, records: list
    ) -> tuple[int, list[str], set[str], int, int, dict[str, int], list[str]]:
        """Ledger records -> (hand-out base, hand-outs from it, refused groups, admission
        offset, admission base, groups closed by a prune, retain list); sets commit/version."""
        base, offset, accepted_base = 0, 0, 0
        handed: list[str] = []
        refused: set[str] = set()
        closed: dict[str, int] = {}
        retain: list[str] = []
        for rec in records:
            if isinstance(rec, Snapshot):
                base, handed = rec.handout_base, []
                self.committed, self.policy_version = rec.committed, rec.version
                offset, accepted_base = rec.accepted_offset, rec.accepted_base
                closed, retain = dict(rec.closed), list(rec.retain)
                self.pruned_segments = rec.pruned_segments
                refused = set()
            elif isinstance(rec, Handout):
                del handed[max(0, rec.start - base) :]
                handed.extend(rec.groups)
            elif isinstance(rec, Refused):
                refused.update(rec.groups)
            elif isinstance(rec, Rewind):
                del handed[max(0, rec.watermark - base) :]
            elif isinstance(rec, CommitMark):
                self.committed = max(self.committed, rec.watermark)
                retain = list(rec.retain)
            elif isinstance(rec, VersionMark):
                self.policy_version = rec.version
            elif isinstance(rec, ResumeMark):
                del handed[max(0, rec.watermark - base) :]
                self.policy_version = rec.version
                offset = rec.accepted_offset
        return base, handed, refused, offset, accepted_base, closed, retain
