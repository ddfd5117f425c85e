"""Durable rollout bank: every accepted trajectory on disk, plus a ledger of hand-outs.

Layout of ``bank_dir``::

    segment_000000.arrow   Arrow IPC *stream* files, one record batch per ingest
    segment_000001.arrow   drain (arrow_batch.SCHEMA + reward_metrics/timings maps),
    ...                    a new segment every ``segment_rows`` rows
    ledger.jsonl           one JSON record per hand-out, stale refusal, filter drop,
                           rewind, commit, version and resume (``LedgerRecord``)

Acknowledged, precisely. ZeroMQ PUSH has no acknowledgement, so the buffer
defines one: a trajectory is *accepted* (acknowledged) once its row has been
written to the current segment and the file flushed to the operating system
(``fsync_every_write`` also forces it to the disk; segments are always fsynced
when rotated). Only then does the buffer count it (``accepted_samples``, the
group's count in ``QueryGroups``, ``accepted_groups`` for admission). A
``kill -9`` of the buffer after that point loses nothing: the kernel still
writes the page. Producers treat a sample as delivered only once the buffer's
counters cover it; after a buffer restart the fleet resubmits whatever it had
not seen covered, and reload + uid dedupe make that resubmission idempotent.

A crash mid-write leaves a truncated last message; the stream format lets the
reader keep the valid prefix (the torn row was never acknowledged). A reloaded
bank never appends to an old segment: it opens the next one. Likewise a torn
last ledger line is dropped and the ledger truncated to its last whole line.

Consumed state. Hand-outs are numbered 0, 1, 2, ... in the order groups leave
the buffer; the ledger records each hand-out (start index, group ids) *before*
the batch is sent. The learner's checkpoint stores its watermark (hand-outs
trained on), and on resume the buffer serves again everything at or past it, in
the original order: nothing lost, nothing repeated. See core.py for the replay.

Pruning (``prune_committed``). Once a checkpoint commits past them, the groups
of a closed segment are no longer needed on disk; core.py and retention.py
decide which segments go. The bank then (1) rewrites the ledger atomically as a
``Snapshot`` (the state the deleted records described: hand-out base, commit,
version, admission counter, the groups still recognised as closed) followed by
the records still needed, (2) deletes the segments and fsyncs the folder. A
crash between the two leaves segments the snapshot already lists as closed: a
reload skips them and the next commit deletes them. ``disk_bytes`` (segments +
ledger) is what ``bank_max_bytes`` bounds.

Left out: an index file (reload reads every remaining segment once); Parquet
export (pyarrow reads the segments directly: ``pa.ipc.open_stream``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pyarrow as pa

from buffer.arrow_batch import METRIC_MAP, SCHEMA, arrow_to_trajectories, trajectories_to_arrow
from buffer.wire import Trajectory
from fleetrl.log import get_logger

log = get_logger(__name__)

BANK_SCHEMA = SCHEMA.append(pa.field("reward_metrics", METRIC_MAP)).append(
    pa.field("timings", METRIC_MAP)
)
SEGMENT_RE = re.compile(r"^segment_(\d{6,})\.arrow$")
LEDGER_NAME = "ledger.jsonl"


def segment_name(index: int) -> str:
    return f"segment_{index:06d}.arrow"


# ---- ledger records (JSON, tagged by "op") ------------------------------------------
class Handout(msgspec.Struct, tag="handout"):
    start: int  # hand-out index of the first group
    groups: list[str]
    version: int  # learner version the batch was composed for


class Refused(msgspec.Struct, tag="refused"):
    groups: list[str]
    version: int


class Dropped(msgspec.Struct, tag="dropped"):
    groups: list[str]
    reason: str


class Rewind(msgspec.Struct, tag="rewind"):
    watermark: int


class CommitMark(msgspec.Struct, tag="commit"):
    watermark: int
    retain: list[str] = []  # groups a producer may still send again (wire.Commit)


class VersionMark(msgspec.Struct, tag="version"):
    version: int


class ResumeMark(msgspec.Struct, tag="resume"):
    version: int
    watermark: int
    accepted_offset: int


class Snapshot(msgspec.Struct, tag="snapshot"):
    """First record of a pruned ledger: what the records it replaced established."""

    handout_base: int  # hand-outs below this index are committed and out of the ledger
    committed: int
    version: int
    accepted_base: int  # admission groups counted by groups no longer read back (= committed)
    accepted_offset: int
    closed: dict[str, int]  # group -> samples accepted: closed for good, skipped on reload
    retain: list[str] = []
    pruned_segments: int = 0  # segments deleted so far (all lives of the bank)


LedgerRecord = (
    Handout | Refused | Dropped | Rewind | CommitMark | VersionMark | ResumeMark | Snapshot
)
_LEDGER_ENCODER = msgspec.json.Encoder()
_LEDGER_DECODER = msgspec.json.Decoder(LedgerRecord)


def to_bank_batch(trajs: list[Trajectory]) -> pa.RecordBatch:
    base = trajectories_to_arrow(trajs)
    metrics = pa.array([list(t.reward_metrics.items()) for t in trajs], METRIC_MAP)
    timings = pa.array([list(t.timings.items()) for t in trajs], METRIC_MAP)
    return pa.RecordBatch.from_arrays([*base.columns, metrics, timings], schema=BANK_SCHEMA)


def read_segment(path: Path) -> Iterator[pa.RecordBatch]:
    """Every whole record batch of a segment; a torn tail (crash mid-write) ends it quietly."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        reader = pa.ipc.open_stream(pa.py_buffer(data))
    except (pa.ArrowInvalid, OSError) as err:
        log.warning("bank segment %s unreadable from the start (%s): skipped", path, err)
        return
    while True:
        try:
            yield reader.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowInvalid, OSError) as err:
            log.warning("bank segment %s ends in a torn message (%s): prefix kept", path, err)
            return


def list_segments(bank_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for p in bank_dir.iterdir() if bank_dir.is_dir() else []:
        m = SEGMENT_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def read_ledger(path: Path, *, repair: bool = False) -> list[LedgerRecord]:
    """All whole ledger records; with ``repair`` truncate the file after the last good one."""
    if not path.exists():
        return []
    records: list[LedgerRecord] = []
    good_bytes = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                records.append(_LEDGER_DECODER.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                log.warning("ledger %s: bad record at byte %d (%s): ignored", path, good_bytes, err)
                break
            good_bytes += len(line)
    if repair and good_bytes != path.stat().st_size:
        log.warning("ledger %s: torn tail cut at byte %d", path, good_bytes)
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return records


class RolloutBank:
    """Append-only writer of segments and ledger; reads them back on reload and rewind."""

    def __init__(
        self, bank_dir: str | Path, *, segment_rows: int, fsync_every_write: bool = False
    ) -> None:
        self.dir = Path(bank_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_rows = segment_rows
        self.fsync_every_write = fsync_every_write
        existing = list_segments(self.dir)
        self.current_segment = existing[-1][0] + 1 if existing else 0
        self._rows_in_segment = 0
        self._file = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._ledger_path = self.dir / LEDGER_NAME
        self._ledger = None
        self._segment_bytes = {i: p.stat().st_size for i, p in existing}
        self._ledger_bytes = self._ledger_path.stat().st_size if self._ledger_path.exists() else 0

    # ---- reading --------------------------------------------------------------------
    def iter_trajectories(self, from_segment: int = 0) -> Iterator[tuple[int, list[Trajectory]]]:
        """(segment index, trajectories of one record batch) in acceptance order."""
        for index, path in list_segments(self.dir):
            if index < from_segment:
                continue
            for batch in read_segment(path):
                yield index, arrow_to_trajectories(batch)

    def read_groups(self, group_ids: set[str], from_segment: int) -> dict[str, list[Trajectory]]:
        """The stored samples of ``group_ids`` (arrival order), scanning from ``from_segment``."""
        found: dict[str, list[Trajectory]] = {g: [] for g in group_ids}
        seen: set[str] = set()
        for _, trajs in self.iter_trajectories(from_segment):
            for t in trajs:
                if t.group_id in found and t.uid not in seen:
                    seen.add(t.uid)
                    found[t.group_id].append(t)
        return found

    def read_ledger(self) -> list[LedgerRecord]:
        return read_ledger(self._ledger_path, repair=self._ledger is None)

    @property
    def disk_bytes(self) -> int:
        """Bytes of segments and ledger on disk (what ``bank_max_bytes`` bounds)."""
        return sum(self._segment_bytes.values()) + self._ledger_bytes

    @property
    def num_segments(self) -> int:
        return len(self._segment_bytes)

    # ---- writing --------------------------------------------------------------------
    def append(self, trajs: list[Trajectory]) -> int:
        """Write ``trajs`` as one batch and flush; returns the segment they landed in."""
        if not trajs:
            return self.current_segment
        if self._writer is None:
            self._open_segment()
        assert self._writer is not None and self._file is not None
        try:
            self._writer.write_batch(to_bank_batch(trajs))
            self._file.flush()
            if self.fsync_every_write:
                os.fsync(self._file.fileno())
        except OSError:
            # the segment may now end in a torn message, and a reader stops there: later
            # (acknowledged) writes must not land behind it, so this segment ends here
            self._abandon_segment()
            raise
        segment = self.current_segment
        self._segment_bytes[segment] = self._file.tell()
        self._rows_in_segment += len(trajs)
        if self._rows_in_segment >= self.segment_rows:
            self._close_segment()
        return segment

    def record(self, entry: LedgerRecord, *, sync: bool = False) -> None:
        """Append one ledger line and flush it (``sync`` also fsyncs)."""
        if self._ledger is None:
            read_ledger(self._ledger_path, repair=True)
            self._ledger = open(self._ledger_path, "ab")  # noqa: SIM115 - held open for appends
        line = _LEDGER_ENCODER.encode(entry) + b"\n"
        self._ledger.write(line)
        self._ledger.flush()
        self._ledger_bytes += len(line)
        if sync or self.fsync_every_write:
            os.fsync(self._ledger.fileno())

    # ---- pruning --------------------------------------------------------------------
    def rewrite_ledger(self, records: list[LedgerRecord]) -> None:
        """Replace the ledger by ``records`` atomically (temp file, fsync, rename, fsync dir)."""
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        tmp = self._ledger_path.with_suffix(".tmp")
        data = b"".join(_LEDGER_ENCODER.encode(r) + b"\n" for r in records)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self._ledger_path)
        self._fsync_dir()
        self._ledger_bytes = len(data)

    def delete_segments(self, indices: list[int]) -> None:
        """Delete closed segments (never the open one) and fsync the folder."""
        for index in indices:
            if index >= self.current_segment:
                raise ValueError(f"segment {index} is not closed (current {self.current_segment})")
            (self.dir / segment_name(index)).unlink(missing_ok=True)
            self._segment_bytes.pop(index, None)
        if indices:
            self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._close_segment()
        if self._ledger is not None:
            self._ledger.flush()
            os.fsync(self._ledger.fileno())
            self._ledger.close()
            self._ledger = None

    def _open_segment(self) -> None:
        path = self.dir / segment_name(self.current_segment)
        self._file = open(path, "xb")  # noqa: SIM115 - closed on rotate
        self._writer = pa.ipc.new_stream(self._file, BANK_SCHEMA)
        self._segment_bytes[self.current_segment] = self._file.tell()
        self._rows_in_segment = 0

    def _abandon_segment(self) -> None:
        writer, file = self._writer, self._file
        self._writer = self._file = None
        self.current_segment += 1
        for closing in (writer, file):
            try:
                if closing is not None:
                    closing.close()
            except OSError as err:  # the disk already failed once: note it, keep going
                log.warning("closing an abandoned bank segment failed: %s", err)

    def _close_segment(self) -> None:
        if self._writer is None or self._file is None:
            return
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._segment_bytes[self.current_segment] = self._file.tell()
        self._file.close()
        self._writer = None
        self._file = None
        self.current_segment += 1  # a closed segment is never reopened
