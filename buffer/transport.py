"""Client side of the buffer: trajectory senders (producers) and control clients (learner, fleet).

Two small interfaces, each with a ZeroMQ implementation for real runs and an
in-process one (over a ``BufferCore`` in the same process) for tests and
debugging, interchangeable behind the same methods:

- ``TrajectorySink``: ``send(traj, timeout_s)``. ``TrajectorySender`` is a PUSH
  socket: at the high-water mark ``send`` blocks - that is the backpressure
  of a full buffer - and with a timeout it raises ``SendTimeout`` instead of
  dropping anything.
- ``BufferControl``: ``get_batch``, ``publish_version``, ``admission``,
  ``stats``, ``commit``, ``resume``, ``group_status``. ``BufferClient`` is a
  DEALER socket speaking the request/reply protocol of wire.py; each request
  carries an id, late replies are discarded, and after a timeout the socket is
  rebuilt so a stale request never surfaces later (ZeroMQ "lazy pirate").

The client tracks the consumer's *received watermark* (hand-outs received in
order) and sends it with every ``GetBatch``, so hand-outs lost in flight are
served again. The learner checkpoints ``received_watermark`` after training on
a batch and calls ``resume(version, watermark)`` when it restarts from it.

Thread safety: each object serialises its own calls with a lock (ZeroMQ sockets
are not thread-safe); for parallel use give each thread its own sender/client.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import zmq

from buffer.arrow_batch import from_ipc
from buffer.core import BufferCore, BufferStateError, check_trajectory
from buffer.security import CurveClientKeys, apply_client
from buffer.wire import (
    KIND_REPLY,
    MAX_MESSAGE_BYTES,
    REQUEST_HEADER,
    TRAJECTORY_HEADER,
    Ack,
    AdmissionState,
    Batch,
    Commit,
    Empty,
    Error,
    FrameError,
    GetAdmission,
    GetBatch,
    GetStats,
    GroupStatus,
    PublishVersion,
    QueryGroups,
    Reply,
    Request,
    Resume,
    Stats,
    Trajectory,
    check_header,
    decode_reply,
    encode,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

REPLY_GRACE_S = 5.0  # beyond a long-poll's own timeout, how long a reply may take


class SendTimeout(TimeoutError):
    """The buffer did not take a trajectory in time (full or down); nothing was dropped."""


class BufferTimeout(TimeoutError):
    """No reply from the buffer's control socket in time."""


class BufferRequestError(RuntimeError):
    """The buffer answered a request with an error."""


@dataclass(frozen=True)
class BatchInfo:
    """Where the last batch sits in the buffer's hand-out order."""

    handout_start: int
    num_groups: int
    num_samples: int
    learner_version: int
    refused_stale: int


class TrajectorySink(ABC):
    @abstractmethod
    def send(self, traj: Trajectory, timeout_s: float | None = None) -> None:
        """Deliver ``traj``; block while the buffer is full; SendTimeout after ``timeout_s``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def __enter__(self) -> TrajectorySink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrajectorySender(TrajectorySink):
    """PUSH trajectories to a buffer's ingest address."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveClientKeys | None = None,
        hwm: int = 1000,
        linger_ms: int = 5000,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.sndhwm = hwm
        self._socket.linger = linger_ms
        if curve is not None:
            apply_client(self._socket, curve)
        self._socket.connect(address)
        self._lock = threading.Lock()
        self.sent = 0

    def send(self, traj: Trajectory, timeout_s: float | None = None) -> None:
        self.send_payload(encode(traj), timeout_s)

    def send_payload(self, payload: bytes, timeout_s: float | None = None) -> None:
        """Send an already msgpack-encoded trajectory (producers that encode off-thread)."""
        with self._lock:
            if timeout_s is not None and not self._socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
                raise SendTimeout(
                    f"buffer at {self.address} took no trajectory for {timeout_s}s: it is full "
                    "(backpressure) or unreachable; the trajectory was not sent"
                )
            self._socket.send_multipart([TRAJECTORY_HEADER, payload], copy=False)
            self.sent += 1

    def close(self) -> None:
        with self._lock:
            if not self._socket.closed:
                self._socket.close()


class BufferControl(ABC):
    """Requests of the learner (batches, versions, watermarks) and the fleet (admission)."""

    received_watermark: int = -1
    last_batch: BatchInfo | None = None

    @abstractmethod
    def get_batch(
        self, num_groups: int, learner_version: int, timeout_s: float
    ) -> pa.RecordBatch | None:
        """Exactly ``num_groups`` whole groups as one record batch, or None after ``timeout_s``."""

    @abstractmethod
    def publish_version(self, version: int) -> None: ...

    @abstractmethod
    def admission(self) -> AdmissionState: ...

    @abstractmethod
    def stats(self) -> dict[str, int | float]: ...

    @abstractmethod
    def commit(self, watermark: int, retain_groups: list[str] | None = None) -> None:
        """Hand-outs below ``watermark`` are trained on and checkpointed; ``retain_groups``
        may still be sent again (see ``wire.Commit``)."""

    @abstractmethod
    def resume(self, version: int, watermark: int) -> int:
        """After a learner restart from a checkpoint; returns the reset accepted_groups."""

    @abstractmethod
    def group_status(self, group_ids: list[str]) -> list[int]:
        """Samples of each group durably accepted (producers resubmit the rest)."""

    def state_dict(self) -> dict[str, int]:
        """What the learner checkpoints: the hand-outs it has received (and trained on)."""
        return {"received_watermark": max(self.received_watermark, 0)}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def _accept_batch(self, batch: Batch) -> pa.RecordBatch:
        if self.received_watermark >= 0 and batch.handout_start != self.received_watermark:
            raise BufferRequestError(
                f"batch starts at hand-out {batch.handout_start}, expected {self.received_watermark}"
            )
        self.last_batch = BatchInfo(
            batch.handout_start,
            batch.num_groups,
            batch.num_samples,
            batch.learner_version,
            batch.refused_stale,
        )
        self.received_watermark = batch.handout_start + batch.num_groups
        return from_ipc(batch.arrow_ipc)


class BufferClient(BufferControl):
    """DEALER client of a BufferService control address."""

    def __init__(
        self,
        control_address: str,
        *,
        curve: CurveClientKeys | None = None,
        timeout_s: float = 30.0,
        received_watermark: int = -1,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = control_address
        self.timeout_s = timeout_s
        self.received_watermark = received_watermark
        self._curve = curve
        self._max_message_bytes = max_message_bytes
        self._context = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.linger = 0
        sock.maxmsgsize = self._max_message_bytes + 4096
        if self._curve is not None:
            apply_client(sock, self._curve)
        sock.connect(self.address)
        return sock

    def _request(self, request: Request, wait_s: float | None = None) -> Reply:
        wait_s = self.timeout_s if wait_s is None else wait_s
        with self._lock:
            request.request_id = next(self._ids)
            if not self._socket.poll(int(wait_s * 1000), zmq.POLLOUT):
                self._reset()
                raise BufferTimeout(f"buffer control {self.address} not reachable in {wait_s}s")
            self._socket.send_multipart([REQUEST_HEADER, encode(request)])
            deadline = time.monotonic() + wait_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    self._reset()
                    raise BufferTimeout(
                        f"no reply from buffer control {self.address} to "
                        f"{type(request).__name__} within {wait_s:.1f}s"
                    )
                frames = self._socket.recv_multipart()
                reply = self._decode(frames)
                if reply is not None and reply.request_id == request.request_id:
                    break
        if isinstance(reply, Error):
            raise BufferRequestError(f"buffer refused {type(request).__name__}: {reply.message}")
        return reply

    def _decode(self, frames: list[bytes]) -> Reply | None:
        try:
            if len(frames) != 2:
                raise FrameError("frame_count", f"{len(frames)} frames")
            check_header(frames[0], KIND_REPLY)
            return decode_reply(frames[1])
        except FrameError as err:
            log.warning("discarding bad reply from %s: %s", self.address, err)
            return None

    def _reset(self) -> None:
        self._socket.close(linger=0)
        self._socket = self._connect()

    def get_batch(
        self, num_groups: int, learner_version: int, timeout_s: float
    ) -> pa.RecordBatch | None:
        request = GetBatch(
            num_groups=num_groups,
            learner_version=learner_version,
            timeout_ms=int(timeout_s * 1000),
            received_watermark=self.received_watermark,
        )
        reply = self._request(request, wait_s=timeout_s + max(REPLY_GRACE_S, self.timeout_s))
        if isinstance(reply, Empty):
            return None
        return self._accept_batch(_expect(reply, Batch))

    def publish_version(self, version: int) -> None:
        _expect(self._request(PublishVersion(version=version)), Ack)

    def admission(self) -> AdmissionState:
        return _expect(self._request(GetAdmission()), AdmissionState)

    def stats(self) -> dict[str, int | float]:
        return _expect(self._request(GetStats()), Stats).counters

    def commit(self, watermark: int, retain_groups: list[str] | None = None) -> None:
        request = Commit(watermark=watermark, retain_groups=list(retain_groups or []))
        _expect(self._request(request), Ack)

    def resume(self, version: int, watermark: int) -> int:
        reply = _expect(self._request(Resume(version=version, watermark=watermark)), Ack)
        self.received_watermark = watermark
        return reply.value

    def group_status(self, group_ids: list[str]) -> list[int]:
        return _expect(self._request(QueryGroups(group_ids=group_ids)), GroupStatus).accepted_counts

    def close(self) -> None:
        with self._lock:
            self._socket.close(linger=0)


def _expect(reply: Reply, typ: type[Any]) -> Any:
    if not isinstance(reply, typ):
        raise BufferRequestError(f"expected a {typ.__name__} reply, got {type(reply).__name__}")
    return reply


# ---- in-process implementations (same process as the BufferCore) -------------------
class InProcessSender(TrajectorySink):
    """Hands trajectories straight to a BufferCore; blocks while it is full."""

    def __init__(self, core: BufferCore) -> None:
        self.core = core
        self.sent = 0

    def send(self, traj: Trajectory, timeout_s: float | None = None) -> None:
        check_trajectory(traj)
        with self.core.ready:
            if not self.core.ready.wait_for(lambda: not self.core.is_full, timeout_s):
                raise SendTimeout(f"in-process buffer full for {timeout_s}s")
            self.core.ingest([traj])
            self.sent += 1


class InProcessBufferClient(BufferControl):
    def __init__(self, core: BufferCore, *, received_watermark: int = -1) -> None:
        self.core = core
        self.received_watermark = received_watermark

    def get_batch(
        self, num_groups: int, learner_version: int, timeout_s: float
    ) -> pa.RecordBatch | None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                taken = self.core.take_batch(num_groups, learner_version, self.received_watermark)
            except BufferStateError as err:
                raise BufferRequestError(str(err)) from None
            if taken is not None:
                return self._accept_batch(taken[0])
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.core.wait_ready(num_groups, remaining):
                return None

    def publish_version(self, version: int) -> None:
        self.core.publish_version(version)

    def admission(self) -> AdmissionState:
        return self.core.admission_state()

    def stats(self) -> dict[str, int | float]:
        return self.core.stats()

    def commit(self, watermark: int, retain_groups: list[str] | None = None) -> None:
        self.core.commit(watermark, retain_groups)

    def resume(self, version: int, watermark: int) -> int:
        accepted = self.core.resume(version, watermark)
        self.received_watermark = watermark
        return accepted

    def group_status(self, group_ids: list[str]) -> list[int]:
        return self.core.group_status(group_ids)
