"""Learner side of co-located weight sync: a version into the engines on this rank's device.

A co-located engine shares its device (or, on CPU, its host) with one learner rank, so
the weights need no collective: the rank packs them into a flat bucket in memory the
engine can map (shared memory on CPU, device memory on CUDA) and POSTs a handle to it
through SGLang's ``/update_weights_from_tensor`` (``load_format="flattened_bucket"``,
one payload entry per engine TP rank: ``weight_sync.ipc_payload``), inside the
engine's ``/begin_weight_update`` ... ``/end_weight_update`` session like every update::

    sender = TensorSender(cfg.weight_sync, device=device)
    sender.set_members(endpoints)               # the engines co-located with this rank
    push = sender.start(version)                # begin on every member
    stream = push.tap(worker.named_full_tensors())  # packs as the stream passes by
    ...                                         # the stream is consumed: drained, or
                                                # broadcast to remote engines meanwhile
    metrics = push.finish()                     # last bucket, end, verify

``publish(stream, version)`` is start, tap, drain, finish. ``tap`` lets one stream of
full tensors feed both paths in a mixed run: the broadcast sender of the remote
engines consumes it while this sender copies each tensor into its bucket.

Buffers: two staging buffers of ``bucket_mb`` (grown for a tensor larger than that: a 7B
model's fp32 embedding makes each ~2.2 GB), made for a push and freed at its end, once every
engine has answered for the bucket it read: on a co-located device the engine generates
next and needs the memory (the memory plan counts them in the push phase only,
``launcher.plan_colocated``). While the engines load one bucket the next is packed into
the other; a buffer is written again only after every engine answered for the bucket it
held, so an engine never reads memory the learner has changed (slime saw corrupted
weights when producer buffers were reused or freed early). On CUDA the device is
synchronized before a handle is sent, so the engine reads finished copies.

Not done here: pausing and memory. The co-location owner (``rollout_fleet.colocation``)
pauses the engines and releases their memory for the learner's step, resumes their
weight memory before this push and their KV cache after it; the KV cache was flushed
when it was released, so no ``flush_cache`` follows (a fresh replacement has none).

Failures: an engine whose call fails or times out is dropped from this version (its
later buckets are skipped) and named in the ``WeightSyncError`` that ``finish``
raises; the others finish. The dropped engine holds part of the version, and the
membership keeps it out of routing until a later push reaches it.

Left out: several TP ranks on several devices (each rank's payload would need a handle
from the learner rank on its own device: co-located engines are TP 1 here).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from fleetrl.log import get_logger
from weight_sync.config import WeightSyncConfig, bucket_mb_for
from weight_sync.engine_client import EngineCallError, EngineClient
from weight_sync.errors import WeightSyncError, describe, drain_stream
from weight_sync.ipc_payload import BucketEntry, encode_bucket, shared_buffer
from weight_sync.metrics import EngineSyncStatus, SyncMetrics
from weight_sync.publisher import Publisher
from weight_sync.verify import SentRows, UncheckedEngines, check_engine

log = get_logger(__name__)

ALIGN = 64  # every tensor starts at a multiple of this many bytes: views need no copy
LOAD_FORMAT = "flattened_bucket"
_MAX_HTTP_THREADS = 16


class _Stage:
    """One staging buffer and the replies for the bucket it holds."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.buffer = shared_buffer(nbytes, device)
        self.entries: list[BucketEntry] = []
        self.used = 0
        self.replies: dict[str, Future] = {}

    def fits(self, nbytes: int) -> bool:
        return _aligned(self.used) + nbytes <= self.buffer.numel()

    def grow(self, nbytes: int) -> None:
        self.buffer = shared_buffer(nbytes, self.device)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        start = _aligned(self.used)
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.buffer[start : start + flat.numel()].copy_(flat)
        self.entries.append(
            BucketEntry(name, tensor.shape, tensor.dtype, start, start + flat.numel(), flat.numel())
        )
        self.used = start + flat.numel()

    def reset(self) -> None:
        self.entries, self.used, self.replies = [], 0, {}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class TensorPush:
    """One version on its way to the members (``TensorSender.start``)."""

    def __init__(self, sender: TensorSender, version: int, verify: bool) -> None:
        self.sender = sender
        self.version = version
        self.started = time.perf_counter()
        self.metrics = SyncMetrics(version=version)
        self.errors: dict[str, str] = {}
        self.clients = sender.member_clients()
        for c in self.clients:
            self.metrics.engines[c.name] = EngineSyncStatus(c.name)
        self.sent = SentRows(sender.config.verify_rows) if verify else None
        self._call_all(lambda c: c.begin_update(), "begin_weight_update")
        self._began = {c.name for c in self._live()}  # their sessions are ended in finish
        self._current = 0
        self._tapped = False
        self.staging_bytes = 0  # what the staging buffers held, freed at the end

    # ---- the stream ----------------------------------------------------------------------

    def tap(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``stream`` through, packing every tensor into the buckets on the way."""
        self._tapped = True
        source = iter(stream)
        if self.sent is not None:
            source = self.sent.observe(source)
        for name, tensor in source:
            t = time.perf_counter()
            self._add(name, tensor)
            self.metrics.gather_s += time.perf_counter() - t
            yield name, tensor

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        stage = self.sender.stages[self._current]
        if not stage.fits(nbytes) and stage.entries:
            self._send(stage)
            self._current = 1 - self._current
            stage = self.sender.stages[self._current]
            self._wait(stage)  # its previous bucket must be loaded before it is written again
        if not stage.fits(nbytes):
            stage.grow(_aligned(nbytes))
        stage.add(name, tensor)
        self.metrics.num_tensors += 1

    def _send(self, stage: _Stage) -> None:
        """POST the bucket ``stage`` holds to every member still in this version."""
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)  # the engine must read finished copies
        flat, weight_version = stage.buffer[: stage.used], str(self.version)
        for client in self._live():
            # one payload per process that opens it (each TP rank of each engine): torch
            # counts a reference per pickling, which the one process unpickling it drops
            entries = [encode_bucket(flat, stage.entries) for _ in range(self.sender.tp_size)]
            stage.replies[client.name] = self.sender.pool.submit(
                _timed_update, client, entries, weight_version
            )
        self.metrics.bytes += stage.used
        self.metrics.num_buckets += 1

    def _wait(self, stage: _Stage) -> None:
        """Wait for the replies to the bucket in ``stage``; drop the engines that failed."""
        deadline = time.monotonic() + self.sender.config.timeout_s
        for name, future in stage.replies.items():
            try:
                load_s = future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
                self.metrics.engines[name].load_s += load_s
            except EngineCallError as err:
                self._fail(name, str(err))
            except FutureTimeout:
                self._fail(
                    name, f"engine {name}: /update_weights_from_tensor: no reply within "
                    f"{self.sender.config.timeout_s:.1f}s",
                )  # fmt: skip
        stage.reset()

    # ---- the end -------------------------------------------------------------------------

    def finish(self) -> SyncMetrics:
        """Send the last bucket, wait for every reply, end the session, verify; raise
        ``WeightSyncError`` naming the engines that failed (the others hold the version)."""
        if not self._tapped:
            raise RuntimeError("TensorPush.finish: tap() the stream first")
        stream_started = time.perf_counter()
        last = self.sender.stages[self._current]
        if last.entries:
            self._send(last)
        for stage in self.sender.stages:
            self._wait(stage)
        self.staging_bytes = self.sender.free_buffers()  # every engine has answered
        self.metrics.engine_load_s = max(
            (s.load_s for s in self.metrics.engines.values()), default=0.0
        )
        self._end_dropped_sessions()
        self._call_all(lambda c: c.end_update(), "end_weight_update")
        if self.sent is not None and self._live():
            t = time.perf_counter()
            self._verify()
            self.metrics.verify_s = time.perf_counter() - t
        self.metrics.total_s = time.perf_counter() - self.started
        stream_s = time.perf_counter() - stream_started + self.metrics.gather_s
        self.metrics.gbps = self.metrics.bytes / stream_s / 1e9 if stream_s > 0 else 0.0
        for name, reason in self.errors.items():
            status = self.metrics.engines[name]
            status.ok, status.error = False, reason
        if self.errors:
            raise WeightSyncError(
                describe(self.errors, f"dropped during version {self.version}"),
                engines=sorted(self.errors),
                version=self.version,
                metrics=self.metrics,
            )
        self.sender.latest_version = self.version
        return self.metrics

    def _end_dropped_sessions(self) -> None:
        """Close the session of every engine dropped after its begin (best effort), so
        that the next version's ``/begin_weight_update`` is accepted."""
        for client in self.clients:
            if client.name in self.errors and client.name in self._began:
                try:
                    client.end_update()
                except EngineCallError as err:
                    log.warning("could not end the weight update on %s: %s", client.name, err)

    def _verify(self) -> None:
        assert self.sent is not None
        sender = self.sender
        names = self.sent.sample(sender.config.verify_tensors)
        futures = {
            c.name: sender.pool.submit(
                check_engine,
                c,
                self.sent,
                names,
                self.version,
                sender.config.verify_rows,
                sender.unchecked,
            )  # fmt: skip
            for c in self._live()
        }
        for name, future in futures.items():
            try:
                problem = future.result()
            except EngineCallError as err:
                problem = str(err).removeprefix(f"engine {name}: ")
            self.metrics.engines[name].verified = not problem
            if problem:
                self._fail(name, f"engine {name}: weights differ from the learner's: {problem}")

    # ---- helpers -------------------------------------------------------------------------

    def _live(self) -> list[EngineClient]:
        return [c for c in self.clients if c.name not in self.errors]

    def _fail(self, name: str, reason: str) -> None:
        if name not in self.errors:
            log.error("dropping engine %s from version %d: %s", name, self.version, reason)
            self.errors[name] = reason

    def _call_all(self, fn, what: str) -> None:
        futures = {c.name: self.sender.pool.submit(fn, c) for c in self._live()}
        deadline = time.monotonic() + self.sender.config.timeout_s
        for name, future in futures.items():
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except EngineCallError as err:
                self._fail(name, str(err))
            except FutureTimeout:
                self._fail(name, f"engine {name}: {what}: no reply")


def _timed_update(client: EngineClient, entries: list[str], weight_version: str) -> float:
    """One bucket's request; returns the seconds the engine took to answer."""
    t = time.perf_counter()
    client.update_weights_from_tensor(
        entries, load_format=LOAD_FORMAT, weight_version=weight_version
    )
    return time.perf_counter() - t


class TensorSender(Publisher):
    """Pushes versions by handle to the co-located engines of one learner rank."""

    def __init__(
        self, config: WeightSyncConfig, *, device: str | torch.device = "cpu", tp_size: int = 1
    ) -> None:
        super().__init__(config)
        self.device = torch.device(device)
        self.tp_size = tp_size
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.bucket_bytes = max(ALIGN, int(bucket_mb_for(config, backend) * 2**20))
        self._stages: list[_Stage] | None = None
        self.pool = ThreadPoolExecutor(_MAX_HTTP_THREADS, thread_name_prefix="tensor-push")
        self.unchecked = UncheckedEngines()

    @property
    def stages(self) -> list[_Stage]:
        """The two staging buffers, made on first use in a push (a rank with no co-located
        engine never allocates them) and freed at its end (``free_buffers``)."""
        if self._stages is None:
            self._stages = [_Stage(self.bucket_bytes, self.device) for _ in range(2)]
        return self._stages

    @property
    def buffer_bytes(self) -> int:
        """Bytes the staging buffers hold now (0 between pushes)."""
        return sum(stage.buffer.numel() for stage in self._stages or [])

    def free_buffers(self) -> int:
        """Drop the staging buffers (no engine reads them any more); the bytes they held."""
        held = self.buffer_bytes
        self._stages = None
        return held

    def _member_removed(self, client: EngineClient) -> None:
        client.close()

    def member_clients(self) -> list[EngineClient]:
        with self._lock:
            return list(self._clients.values())

    def start(self, version: int, *, verify: bool | None = None) -> TensorPush:
        """Open the update session on every member for ``version``; then ``tap`` and ``finish``."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        return TensorPush(self, version, self.config.verify if verify is None else verify)

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        verify: bool | None = None,
    ) -> SyncMetrics:
        push = self.start(version, verify=verify)
        drain_stream(push.tap(named_tensors))
        return push.finish()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._stages = None
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
