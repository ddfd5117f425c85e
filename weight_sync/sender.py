"""Learner side of weight sync: publish versioned weights to every rollout engine.

One ``WeightSender`` lives on learner rank 0. Per version, every FSDP rank walks
``LearnerWorker.named_full_tensors()`` (a collective); rank 0 hands its stream
to ``publish``, the other ranks drain theirs (``drain_stream``):

    sender = WeightSender(cfg.weight_sync, master_address="127.0.0.1", device="cpu")
    sender.connect([EngineEndpoint("engine-0", "http://127.0.0.1:30000", None)])
    metrics = sender.publish(worker.named_full_tensors(), version=v)   # rank 0
    drain_stream(worker.named_full_tensors())                          # ranks > 0

``publish`` in order (SGLang 0.5.23's protocol, DESIGN.md §5):
  1. (re)form the group if membership changed: rank 0 serves a TCPStore, POSTs
     ``/init_weights_update_group`` to each engine with its ``rank_offset``
     (an engine with TP t takes t consecutive ranks) while joining as rank 0
     the way SGLang's engine ranks join (see ``group``). Before any pause: an
     engine that joined the fleet (or one that left) costs the others no paused
     time here (the embedded engine forms the group on a thread of its own while
     it generates; SGLang's scheduler holds generation for the rendezvous);
  2. pause every engine (``config.pause_mode``) - concurrently; an engine that
     fails it is dropped and the group formed again without it;
  3. ``/begin_weight_update`` on every engine (SGLang refuses updates outside);
  4. pack the stream into dtype-grouped flat buckets of ``bucket_mb`` (on CPU,
     tensors of at least ``config.ZERO_COPY_MB`` go uncopied in per-tensor
     requests instead, see ``buckets``); per bucket: POST
     ``/update_weights_from_distributed`` (``load_format="flattened_bucket"``,
     or None for a per-tensor request; ``flush_cache`` false) to every engine in
     threads, start the broadcast, then gather and pack the next bucket while it
     is in flight (one-bucket lookahead), then wait for the broadcast and every
     reply;
  5. ``/end_weight_update``; then ``/flush_cache`` once, unless the pause was
     in_place (see ``flushes_cache``);
  6. continue every engine;
  7. if ``config.verify``: each engine's ``/model_info`` version and
     ``/get_weights_by_name`` rows against what was sent (``verify``): a spread
     of ``verify_tensors`` tensors on a group's first publish, then
     ``verify_tensors_per_version`` a version, in turns through the stream.

Failures: any call or broadcast that fails or exceeds ``config.timeout_s``
drops the engine(s) it names; ``publish`` finishes for the others where it can
and then raises ``WeightSyncError`` naming the dropped engines, carrying the
metrics. If a broadcast fails mid-stream the group is aborted (no collective
can hang), the rest of the stream is drained (so the other FSDP ranks never
block), and the surviving engines, which now hold partial weights, stay paused
with ``needs_resend`` set: the caller must publish again (the same version is
fine) - the next ``publish`` rebuilds the group without the dead engine.

Membership: who receives weights is not the sender's to decide. In a run the
rollout side's ``rollout_fleet.membership.Membership`` owns it and hands the
targets of each publish over; ``set_members`` makes the sender's connections
exactly those (``add_engine`` / ``remove_engine`` / ``connect`` do the same one
engine at a time, for ``fleetrl weights push`` and tests). A change takes effect
at the next ``publish`` (the group is destroyed and rebuilt), which sends the new
engine the full weights like everyone else: every publish sends everything, so
"resend the latest" is simply another ``publish`` of the current weights. What
a publish did to each engine (dropped, holding part of the version) is reported
in its ``WeightSyncError``, not kept here: the membership records it.

Resume: after restoring a checkpoint at version v, the launcher calls
``publish_restored(worker.named_full_tensors(), v)`` (all ranks driving the
stream) before any engine generates - engines otherwise serve their initial
weights tagged with a version they do not hold.

``config.load_format = "per_tensor"`` sends SGLang's default format instead (one
broadcast per tensor, one request per ``bucket_mb`` of metadata), for engines
without ``flattened_bucket`` support; it is also the per-parameter baseline of
``bench.weight_sync``.

Co-located engines (``rollout.placement: colocated``) are not reached through this
group: each learner rank pushes to the engine on its device by handle
(``weight_sync.tensor_push``); in a mixed run this sender broadcasts to the remote
engines the same stream those pushes tap.

Left out: sending only changed tensors.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from fleetrl.log import get_logger
from weight_sync.buckets import Bucket, BufferPool, pack_buckets
from weight_sync.config import WeightSyncConfig, bucket_mb_for, zero_copy_bytes_for
from weight_sync.engine_client import EngineCallError, EngineClient, EngineEndpoint
from weight_sync.errors import BucketFailure, WeightSyncError, describe, drain_stream
from weight_sync.group import BroadcastGroup, GroupError, MasterStore, WeightGroup, resolve_backend
from weight_sync.metrics import EngineSyncStatus, SyncMetrics
from weight_sync.publisher import Publisher
from weight_sync.sender_group import GroupLifecycle
from weight_sync.verify import SentRows, UncheckedEngines, check_engine

__all__ = [
    "EngineEndpoint",
    "EngineSyncStatus",
    "SyncMetrics",
    "WeightSender",
    "WeightSyncError",
    "drain_stream",
]

log = get_logger(__name__)

_MAX_HTTP_THREADS = 64
# how often a bucket's broadcast checks whether an engine already refused it
_REFUSAL_CHECK_S = 0.25


class WeightSender(GroupLifecycle, Publisher):
    """Owns the weight-update group on learner rank 0 and the HTTP clients of every engine."""

    def __init__(
        self,
        config: WeightSyncConfig,
        *,
        master_address: str = "127.0.0.1",
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(config)
        self.master_address = master_address
        self.device = torch.device(device)
        self.backend = resolve_backend(config.backend, self.device)
        self.bucket_bytes = max(1, int(bucket_mb_for(config, self.backend) * 2**20))
        self.zero_copy_bytes = zero_copy_bytes_for(config, self.device.type)
        # CPU bucket buffers are reused across buckets and versions (see ``buckets``); on
        # CUDA the caching allocator already reuses them, and nothing stays pinned here.
        self._bucket_pool = BufferPool(
            self.bucket_bytes, self.device, max_free=4 if self.device.type == "cpu" else 0
        )
        self._group: WeightGroup | None = None
        self._store: MasterStore | None = None
        self._group_clients: list[EngineClient] = []
        self._generation = 0
        self._instance = uuid.uuid4().hex[:8]  # torch allows one group per name per process
        self._pool = ThreadPoolExecutor(_MAX_HTTP_THREADS, thread_name_prefix="weight-sync-http")
        self._unchecked = UncheckedEngines()
        self._fully_verified = -1  # the group generation whose first publish verified clean
        self._turn = 0  # where the next publish's per-version comparison starts in the stream
        # removed (not dropped) engines still in the current group: told to leave it when it
        # is torn down, then closed
        self._leaving: list[EngineClient] = []

    # ------------------------------------------------------------------ membership

    @property
    def flushes_cache(self) -> bool:
        """Whether each version ends with ``/flush_cache``: after an abort or retract pause the
        engine is idle and SGLang flushes; after in_place it refuses (requests still run), so
        SGLang engines run without a radix cache instead (see ``rollout_fleet.sglang_launcher``)."""
        return self.config.pause_mode != "in_place"

    @property
    def group_name(self) -> str | None:
        return self._group.group_name if self._group else None

    def _member_removed(self, client: EngineClient) -> None:
        self._leaving.append(client)  # told to leave the group when it is rebuilt, then closed

    def connect(self, engines: Iterable[EngineEndpoint]) -> None:
        """Add engines and form the group now. Engines that cannot join are dropped and named in a WeightSyncError."""
        for endpoint in engines:
            self.add_engine(endpoint)
        errors = self._ensure_group()
        if errors:
            raise WeightSyncError(
                describe(errors, "could not join the weight group"), engines=sorted(errors)
            )

    # ------------------------------------------------------------------ publish

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        verify: bool | None = None,
    ) -> SyncMetrics:
        """Send one version of the weights to every member engine (see the module docstring)."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        verify = self.config.verify if verify is None else verify
        started = time.perf_counter()
        stream = iter(named_tensors)
        errors: dict[str, str] = {}
        metrics = SyncMetrics(
            version=version, engines={n: EngineSyncStatus(n) for n in self.engines}
        )

        t0 = time.perf_counter()
        errors.update(self._ensure_group())  # a new member joins while the others generate
        metrics.group_setup_s = time.perf_counter() - t0
        paused_at = time.perf_counter()
        errors.update(self._call_all(lambda c: c.pause(self.config.pause_mode), "pause"))
        metrics.pause_s = time.perf_counter() - paused_at
        if errors:  # an engine dropped by its pause must leave the group first
            t0 = time.perf_counter()
            errors.update(self._ensure_group())
            metrics.group_setup_s += time.perf_counter() - t0

        sent = SentRows(self.config.verify_rows) if verify else None
        if sent is not None:
            stream = sent.observe(stream)
        errors.update(self._call_group(lambda c: c.begin_update(), "begin_weight_update"))
        if self._group is None:
            drain_stream(stream)
        else:
            try:
                self._stream_buckets(stream, version, metrics)
            except BucketFailure as failure:
                blamed, partial = self._after_bucket_failure(failure)
                errors.update(blamed)
                drain_stream(stream)
                metrics.total_s = time.perf_counter() - started
                self._record(metrics, errors)
                raise WeightSyncError(
                    describe(errors, f"version {version} broadcast failed ({failure.reason})")
                    + (
                        f"; engines {partial} hold partial weights, paused until the next publish"
                        if partial
                        else ""
                    ),
                    engines=sorted(errors),
                    version=version,
                    metrics=metrics,
                    partial=partial,
                ) from None
            except BaseException:
                self._abort_version()
                raise
        errors.update(self._call_group(lambda c: c.end_update(str(version)), "end_weight_update"))
        if self.flushes_cache:
            errors.update(self._call_group(lambda c: c.flush_cache(), "flush_cache"))

        t0 = time.perf_counter()
        errors.update(self._call_all(lambda c: c.resume(), "continue"))
        metrics.resume_s = time.perf_counter() - t0
        metrics.paused_s = time.perf_counter() - paused_at
        self.latest_version = version

        mismatched: dict[str, str] = {}
        if sent is not None and self._group_clients:
            t0 = time.perf_counter()
            mismatched = self._verify(sent, version, metrics)
            metrics.verify_s += time.perf_counter() - t0
        metrics.total_s = time.perf_counter() - started
        self._record(metrics, {**errors, **mismatched})
        log.debug("%s", metrics.summary())  # per version: metrics.jsonl has it
        if errors or mismatched:
            message = "; ".join(
                part
                for part in (
                    describe(errors, f"dropped during version {version}") if errors else "",
                    describe(mismatched, "weights differ from the learner's") if mismatched else "",
                )
                if part
            )
            raise WeightSyncError(
                message, engines=sorted({**errors, **mismatched}), version=version, metrics=metrics
            )
        return metrics

    def _abort_version(self) -> None:
        """The learner's own stream failed mid-version: abort whatever is in flight; every
        member got part of this version and must get all of the next one (every publish
        sends everything, so the next one does)."""
        for client in self._group_clients:
            self._best_effort_end(client)
        self._teardown_group(notify=True, abort=True)

    @staticmethod
    def _next_bucket(buckets: Iterator[Bucket], metrics: SyncMetrics) -> Bucket | None:
        """The next bucket, or None at the end; the time blocked counts as gathering."""
        t = time.perf_counter()
        bucket = next(buckets, None)
        metrics.gather_s += time.perf_counter() - t
        return bucket

    def _stream_buckets(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int, metrics: SyncMetrics
    ) -> None:
        group = self._group
        assert group is not None
        clients = list(self._group_clients)
        per_tensor = all(c.takes_per_tensor_broadcasts for c in clients)
        buckets = pack_buckets(
            stream,
            self.bucket_bytes,
            self.device,
            self._bucket_pool,
            zero_copy_bytes=self.zero_copy_bytes if per_tensor else None,
        )
        bucket = self._next_bucket(buckets, metrics)
        stream_started = time.perf_counter()
        while bucket is not None:
            bucket_started = time.perf_counter()
            deadline = time.monotonic() + self.config.timeout_s
            replies = {
                c.name: self._pool.submit(
                    self._post_update,
                    c,
                    bucket,
                    group.group_name,
                    version,
                    bucket.load_format,
                )
                for c in clients
            }
            try:
                works = [group.broadcast(t) for t in bucket.broadcast_tensors()]
            except (RuntimeError, GroupError) as err:
                raise BucketFailure(
                    f"bucket {bucket.index}: {err}", self._gather_calls(replies, deadline)
                ) from None
            done_at: list[float] = []
            works[-1].get_future().add_done_callback(
                lambda _f, d=done_at: d.append(time.perf_counter())
            )
            next_bucket = self._next_bucket(buckets, metrics)  # while the broadcast is in flight
            what = f"broadcast of bucket {bucket.index} ({bucket.nbytes} bytes)"
            try:
                for work in works:
                    self._wait_unless_refused(group, work, what, deadline, replies)
            except GroupError as err:
                raise BucketFailure(str(err), self._gather_calls(replies, deadline)) from None
            broadcast_done = done_at[0] if done_at else time.perf_counter()
            metrics.broadcast_s += broadcast_done - bucket_started
            bucket_errors = self._gather_calls(replies, deadline)
            if bucket_errors:
                raise BucketFailure(f"update of bucket {bucket.index}", bucket_errors)
            for name, future in replies.items():
                status = metrics.engines.setdefault(name, EngineSyncStatus(name))
                status.load_s += max(0.0, future.result() - broadcast_done)
            metrics.bytes += bucket.nbytes
            metrics.num_buckets += 1
            metrics.num_tensors += len(bucket.metas)
            bucket.release(self._bucket_pool)  # sent and loaded everywhere: reuse its buffer
            bucket = next_bucket
        stream_s = time.perf_counter() - stream_started
        metrics.gbps = metrics.bytes / stream_s / 1e9 if stream_s > 0 else 0.0
        metrics.engine_load_s = max((s.load_s for s in metrics.engines.values()), default=0.0)

    def _wait_unless_refused(
        self,
        group: BroadcastGroup,
        work: Any,
        what: str,
        deadline: float,
        replies: dict[str, Future],
    ) -> None:
        """Wait for ``work`` until ``deadline``, but stop as soon as an engine has answered
        the bucket's update call with an error: it will not join the broadcast, which then
        cannot complete (waiting out the timeout cost a minute per version)."""
        while True:
            slice_end = min(deadline, time.monotonic() + _REFUSAL_CHECK_S)
            try:
                group.wait(work, what, slice_end)
                return
            except GroupError:
                if work.is_completed() or slice_end >= deadline:
                    raise  # the backend failed, or the whole deadline passed
            refused = {n: f for n, f in replies.items() if f.done() and f.exception()}
            if refused:
                raise BucketFailure(
                    f"{what}: refused by {', '.join(sorted(refused))}",
                    self._gather_calls(refused, deadline),
                )

    @staticmethod
    def _post_update(
        client: EngineClient,
        bucket: Bucket,
        group_name: str,
        version: int,
        load_format: str | None,
    ) -> float:
        client.update_weights(
            bucket.wire_fields(),
            group_name=group_name,
            weight_version=str(version),
            load_format=load_format,
        )
        return time.perf_counter()

    def _gather(self, futures: dict[str, Future], deadline: float) -> dict[str, str]:
        """Wait for every future until ``deadline``; return ``{engine: error}`` for those that failed."""
        return {name: str(err) for name, err in self._gather_calls(futures, deadline).items()}

    def _gather_calls(
        self, futures: dict[str, Future], deadline: float
    ) -> dict[str, EngineCallError]:
        errors: dict[str, EngineCallError] = {}
        for name, future in futures.items():
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except EngineCallError as err:
                errors[name] = err
            except FutureTimeout:
                errors[name] = EngineCallError(
                    name,
                    "request",
                    f"no reply within {self.config.timeout_s:.1f}s",
                    unreachable=True,
                )
        return errors

    def _after_bucket_failure(self, failure: BucketFailure) -> tuple[dict[str, str], list[str]]:
        """Abort the group, decide which engines are to blame, drop them; returns them and
        the survivors, which now hold part of the version."""
        members = list(self._group_clients)
        group_name = self._group.group_name if self._group else ""
        self._teardown_group(notify=False, abort=True)
        errors = self._blame(members, failure.errors, failure.reason)
        blamed = set(errors)
        for name in blamed:
            self._drop(name, errors[name])
        partial = sorted(c.name for c in members if c.name not in blamed)
        for client in members:
            if client.name not in blamed:
                self._best_effort_end(client)
                self._best_effort_destroy(client, group_name)
        return errors, partial

    def _verify(self, sent: SentRows, version: int, metrics: SyncMetrics) -> dict[str, str]:
        """Ask every engine what it serves (``verify``); ``{engine: why}`` for those that differ.

        The first publish to a group compares ``verify_tensors`` tensors spread over the
        stream; later ones ``verify_tensors_per_version``, taking turns through it.
        """
        first = self._fully_verified != self._generation
        if first:
            names = sent.sample(self.config.verify_tensors)
        else:
            streamed, count = (
                sent.names,
                min(self.config.verify_tensors_per_version, len(sent.names)),
            )
            names = [streamed[(self._turn + i) % len(streamed)] for i in range(count)]
            self._turn = (self._turn + count) % max(len(streamed), 1)
        futures = {
            c.name: self._pool.submit(
                check_engine, c, sent, names, version, self.config.verify_rows, self._unchecked
            )
            for c in self._group_clients
        }
        mismatched: dict[str, str] = {}
        for name, future in futures.items():
            status = metrics.engines.setdefault(name, EngineSyncStatus(name))
            try:
                problem = future.result()
            except EngineCallError as err:
                problem = str(err).removeprefix(f"engine {name}: ")
            status.verified = not problem
            if problem:
                mismatched[name] = f"engine {name}: {problem}"
        if first and not mismatched:
            self._fully_verified = self._generation
        return mismatched

    # ------------------------------------------------------------------ helpers

    def _call_all(self, fn: Any, what: str, only: set[str] | None = None) -> dict[str, str]:
        """Call ``fn(client)`` on every member (or those in ``only``) concurrently; drop and
        return those that fail."""
        with self._lock:
            clients = [c for c in self._clients.values() if only is None or c.name in only]
        futures = {c.name: self._pool.submit(fn, c) for c in clients}
        errors = self._gather(futures, time.monotonic() + self.config.timeout_s)
        for name, reason in errors.items():
            log.warning("%s failed: %s", what, reason)
            self._drop(name, reason)
        return errors

    def _call_group(self, fn: Any, what: str) -> dict[str, str]:
        """``_call_all`` for the engines in the current group only (none when no group)."""
        members = {c.name for c in self._group_clients}
        return self._call_all(fn, what, only=members)

    def _drop(self, name: str, reason: str) -> None:
        with self._lock:
            client = self._clients.pop(name, None)
        if client is not None:
            log.error("dropping engine %s from weight sync: %s", name, reason)

    @staticmethod
    def _record(metrics: SyncMetrics, errors: dict[str, str]) -> None:
        for name, reason in errors.items():
            status = metrics.engines.setdefault(name, EngineSyncStatus(name))
            status.ok = False
            status.error = reason

    def close(self) -> None:
        """Destroy the group on every engine (best effort) and release sockets and threads."""
        self._teardown_group(notify=True, abort=False)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients.values():
                client.close()
