"""Buffer section of the run config: staleness bound, capacity, filters, rollout bank."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class BufferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_staleness: Annotated[
        int,
        Meta(
            ge=0,
            description="η: a sample may be at most this many policy versions older than the learner when trained on (0 = synchronous, on-policy).",
        ),
    ] = 1
    admission_lead: Annotated[
        Literal["adaptive", "bound"],
        Meta(
            description="How far ahead of the learner the fleet generates. bound (the default): as far as max_staleness allows, so a fleet faster than the learner trains every sample at staleness η; adaptive (opt-in): the fewest versions (1..η) that keep the learner fed, one more whenever it waits for a batch, one fewer when a whole version's groups sit ready at hand-out (buffer/lead.py), which trains on fresher samples and changes a run's results. max_staleness is the bound either way; η = 0 stays synchronous."
        ),
    ] = "bound"
    capacity_groups: Annotated[
        int, Meta(ge=1, description="Groups held before producers block (backpressure).")
    ] = 1024
    filter_equal_scores: Annotated[
        bool,
        Meta(
            description="Drop (and count) groups whose scores are all equal (DAPO dynamic sampling)."
        ),
    ] = False
    filter_truncated: Annotated[
        bool, Meta(description="Drop (and count) responses cut at max_new_tokens.")
    ] = False
    bank_dir: Annotated[
        str,
        Meta(
            description="Durable rollout bank folder (Arrow segments); empty = <run dir>/rollout_bank."
        ),
    ] = ""
    segment_rows: Annotated[
        int,
        Meta(
            ge=1,
            description="Trajectories per bank segment before it is closed and a new one opened.",
        ),
    ] = 256
    max_message_bytes: Annotated[
        int,
        Meta(
            ge=1024,
            description="Largest ZeroMQ message accepted; bigger ones are dropped and counted.",
        ),
    ] = 64 * 1024 * 1024
    high_water_mark: Annotated[
        int, Meta(ge=1, description="ZeroMQ send/receive high-water mark (messages).")
    ] = 1000
    fsync_every_write: Annotated[
        bool,
        Meta(
            description="fsync the bank after every append, not only on segment rotation (survives power loss, not just a killed process; slower)."
        ),
    ] = False
    ingest_drain_messages: Annotated[
        int,
        Meta(
            ge=1,
            description="Most trajectories read from the ingest socket per bank write (one Arrow batch and one flush each).",
        ),
    ] = 256
    prune_committed: Annotated[
        bool,
        Meta(
            description="Delete bank segments, and forget the uids and counts of groups, once a checkpoint commits past them (buffer/retention.py says why nothing is lost or repeated); false keeps the whole bank as an audit trail.",
        ),
    ] = True
    bank_max_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="Bound on the rollout bank's bytes on disk (segments + ledger); 0 = none. Over it, ingest waits (backpressure, nothing dropped) for a commit to prune, as long as a batch's worth of groups is ready; size it to hold at least two checkpoint intervals of samples.",
        ),
    ] = 0
