"""The buffer service: one thread polling a PULL ingest socket and a ROUTER control socket.

::

    producers --PUSH--> [PULL ingest] --decode, check, bank (flush), count--> GroupStore
                                  ^ not polled while the store is full: producers block
                                    at their high-water mark (backpressure, nothing dropped)
    learner/fleet --DEALER--> [ROUTER control] --GetBatch--> take whole groups -> Batch
                                  | not enough yet: the request is parked until groups
                                    complete or its timeout_ms passes (then Empty)

One thread owns both sockets (ZeroMQ sockets are not thread-safe) and the
``BufferCore`` holds all state behind one lock, so ``stats()`` and friends may
be called from any thread (a Ray actor wrapping this class, for instance).
ROUTER uses ROUTER_MANDATORY: a reply to a vanished client raises instead of
vanishing silently, and an unsent batch goes back to the head of the queue.
Both sockets set ZMQ_MAXMSGSIZE (a bigger frame makes ZeroMQ drop that
connection before allocating it) and the service checks the total size of
every message (counted ``rejected_frames.oversized``). Malformed, truncated,
wrong-schema and oversized messages are counted by reason, logged and dropped;
they never stop the loop. Off loopback both sockets require CURVE.

Run standalone: ``fleetrl buffer --bind tcp://127.0.0.1:5555 --bank-dir DIR``
(control on port+1) or ``python -m buffer.service`` with the same flags.

Left out: several consumers with separate watermarks; a socket monitor that
counts connections ZeroMQ itself dropped for oversized frames.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from buffer.admission import derive_groups_per_version
from buffer.arrow_batch import trajectories_to_arrow
from buffer.config import BufferConfig
from buffer.core import BufferCore, BufferStateError
from buffer.security import (
    CurveServerKeys,
    InsecureBindError,
    apply_server,
    check_bind_allowed,
    refused_clients,
    start_authenticator,
)
from buffer.wire import (
    KIND_REQUEST,
    REPLY_HEADER,
    Ack,
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
    check_header,
    decode_request,
    encode,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

POLL_INTERVAL_MS = 100  # how often the loop notices stop() when idle
MAX_CONTROL_PER_ROUND = 64  # control messages handled before ingest gets a turn
STANDALONE_MAX_CONCURRENT = 64  # rollout.max_concurrent_groups default (no rollout_fleet import)
STANDALONE_GROUPS_PER_VERSION = 8  # data.train_batch_size fallback when the config has none


@dataclass
class _Parked:
    identity: bytes
    request: GetBatch
    deadline: float


class BufferService:
    """The ZeroMQ face of a BufferCore. Plain-data constructor arguments (Ray-friendly)."""

    def __init__(
        self,
        config: BufferConfig,
        *,
        ingest_address: str,
        control_address: str,
        bank_dir: str | Path,
        curve: CurveServerKeys | None = None,
        groups_per_version: int,
        max_concurrent_groups: int,
    ) -> None:
        check_bind_allowed(ingest_address, curve)
        check_bind_allowed(control_address, curve)
        self.config = config
        self._ingest_address = ingest_address
        self._control_address = control_address
        self._bank_dir = Path(bank_dir)
        self._curve = curve
        self._groups_per_version = groups_per_version
        self._max_concurrent = max_concurrent_groups
        self.core: BufferCore | None = None
        self.addresses: tuple[str, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._parked: list[_Parked] = []
        self._failure: BaseException | None = None
        self._auth = None

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> tuple[str, str]:
        """Reload the bank, bind, start the loop; return the bound (ingest, control) addresses."""
        if self._thread is not None:
            raise RuntimeError("BufferService already started")
        self.core = BufferCore(
            self.config,
            bank_dir=self._bank_dir,
            groups_per_version=self._groups_per_version,
            max_concurrent_groups=self._max_concurrent,
        )
        self._context = zmq.Context()
        self._auth = start_authenticator(self._context, self._curve) if self._curve else None
        limit = self.config.max_message_bytes + 4096  # room for the header frames
        self._pull = self._socket(zmq.PULL, limit)
        self._pull.rcvhwm = self.config.high_water_mark
        self._router = self._socket(zmq.ROUTER, limit)
        self._router.router_mandatory = 1
        self._pull.bind(self._ingest_address)
        self._router.bind(self._control_address)
        self.addresses = (
            self._pull.getsockopt_string(zmq.LAST_ENDPOINT),
            self._router.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self._thread = threading.Thread(target=self._run, name="buffer-service", daemon=True)
        self._thread.start()
        log.info("buffer serving: ingest %s, control %s", *self.addresses)
        return self.addresses

    def _socket(self, kind: int, max_bytes: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.linger = 0
        sock.maxmsgsize = max_bytes
        if self._curve is not None:
            apply_server(sock, self._curve)
        return sock

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, answer parked requests with Empty, close sockets and the bank."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"buffer service loop did not stop within {timeout_s}s")
        self._pull.close()
        self._router.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        assert self.core is not None
        self.core.close()
        self._thread = None

    def stats(self) -> dict[str, int | float]:
        if self.core is None:
            raise RuntimeError("BufferService not started")
        out = self.core.stats()
        out["parked_requests"] = len(self._parked)
        if self._auth is not None:
            out["curve_refused_clients"] = refused_clients(self._auth)
        return out

    @property
    def failure(self) -> BaseException | None:
        """The exception that ended the loop, if it ended by one."""
        return self._failure

    # ---- loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            # pyarrow imports pandas on the first array it builds (0.2 s idle, a second on a
            # busy machine): here, while the run starts, not on the first group handed in
            trajectories_to_arrow([])
            self._loop()
        except BaseException as err:  # logged and kept: the owner sees it via .failure
            self._failure = err
            log.exception("buffer service loop died")
            raise
        finally:
            for parked in self._parked:
                self._send(parked.identity, Empty(reason="shutting_down"))
            self._parked.clear()

    def _loop(self) -> None:
        core = self.core
        assert core is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        ingest_polled = False
        while not self._stop.is_set():
            want_ingest = not core.is_full
            if want_ingest != ingest_polled:
                if want_ingest:
                    poller.register(self._pull, zmq.POLLIN)
                else:
                    poller.unregister(self._pull)
                ingest_polled = want_ingest
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self._router in events:
                self._drain_control()
            if self._pull in events:
                self._drain_ingest()
            self._serve_parked()

    def _poll_timeout_ms(self) -> int:
        if not self._parked:
            return POLL_INTERVAL_MS
        soonest = min(p.deadline for p in self._parked) - time.monotonic()
        return max(0, min(POLL_INTERVAL_MS, int(soonest * 1000) + 1))

    def _drain_ingest(self) -> None:
        messages = []
        for _ in range(self.config.ingest_drain_messages):
            try:
                messages.append(self._pull.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        if messages:
            self.core.ingest_messages(messages)

    def _drain_control(self) -> None:
        for _ in range(MAX_CONTROL_PER_ROUND):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                request = self._decode_request(body)
            except FrameError as err:
                self.core.reject(err.reason, f"control: {err}")
                self._send(identity, Error(message=f"rejected request ({err.reason}): {err}"))
                continue
            self._handle(identity, request)

    def _decode_request(self, body: list[bytes]) -> Request:
        size = sum(len(f) for f in body)
        if size > self.config.max_message_bytes:
            raise FrameError("oversized", f"{size} bytes > {self.config.max_message_bytes}")
        if len(body) != 2:
            raise FrameError("frame_count", f"control message has {len(body)} frames, not 2")
        check_header(body[0], KIND_REQUEST)
        return decode_request(body[1])

    def _handle(self, identity: bytes, request: Request) -> None:
        core = self.core
        rid = request.request_id
        try:
            if isinstance(request, GetBatch):
                self._get_batch(identity, request)
                return
            if isinstance(request, PublishVersion):
                core.publish_version(request.version)
                reply: Reply = Ack(request_id=rid, value=request.version)
            elif isinstance(request, GetAdmission):
                reply = core.admission_state()
                reply.request_id = rid
            elif isinstance(request, GetStats):
                reply = Stats(request_id=rid, counters=self.stats())
            elif isinstance(request, Commit):
                core.commit(request.watermark, request.retain_groups)
                reply = Ack(request_id=rid, value=request.watermark)
            elif isinstance(request, Resume):
                accepted = core.resume(request.version, request.watermark)
                reply = Ack(request_id=rid, value=accepted)
            elif isinstance(request, QueryGroups):
                reply = GroupStatus(
                    request_id=rid, accepted_counts=core.group_status(request.group_ids)
                )
            else:  # the Request union is exhaustive; a new op without a handler lands here
                reply = Error(request_id=rid, message=f"unhandled request {type(request).__name__}")
        except (BufferStateError, ValueError) as err:
            reply = Error(request_id=rid, message=str(err))
        self._send(identity, reply)

    def _get_batch(self, identity: bytes, request: GetBatch) -> None:
        if request.num_groups < 1:
            self._send(
                identity, Error(request_id=request.request_id, message="num_groups must be >= 1")
            )
            return
        if not self._try_serve(identity, request):
            if request.timeout_ms > 0:
                deadline = time.monotonic() + request.timeout_ms / 1000
                self._parked.append(_Parked(identity, request, deadline))
            else:
                self._send(identity, Empty(request_id=request.request_id, reason="timeout"))

    def _try_serve(self, identity: bytes, request: GetBatch) -> bool:
        """Answer ``request`` with a batch if one can be made now (or with an Error)."""
        try:
            taken = self.core.take_batch(
                request.num_groups, request.learner_version, request.received_watermark
            )
        except BufferStateError as err:
            self._send(identity, Error(request_id=request.request_id, message=str(err)))
            return True
        if taken is None:
            return False
        batch, groups = taken
        batch.request_id = request.request_id
        if not self._send(identity, batch):
            self.core.return_unsent(batch, groups)
        return True

    def _serve_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        still: list[_Parked] = []
        for parked in self._parked:
            if self._try_serve(parked.identity, parked.request):
                continue
            if parked.deadline <= now:
                self._send(
                    parked.identity, Empty(request_id=parked.request.request_id, reason="timeout")
                )
            else:
                still.append(parked)
        self._parked = still

    def _send(self, identity: bytes, reply: Reply) -> bool:
        """Reply to ``identity``; False (counted) if that client is gone or not reading."""
        try:
            self._router.send_multipart([identity, REPLY_HEADER, encode(reply)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as err:  # EHOSTUNREACH (ROUTER_MANDATORY) or EAGAIN (peer full)
            self.core.counters["undeliverable_replies"] += 1
            kind = type(reply).__name__
            log.warning("reply %s to client %s undeliverable: %s", kind, identity.hex(), err)
            return False


# ---- command line ---------------------------------------------------------------------
_TCP_RE = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:]+):(?P<port>\d+)$")


class AddressError(ValueError):
    """A --bind address the standalone buffer cannot use."""


def control_address_for(ingest_address: str) -> str:
    """The control ROUTER address of ``fleetrl buffer --bind``: same host, port + 1 (0 stays 0)."""
    m = _TCP_RE.match(ingest_address)
    if not m:
        raise AddressError(f"--bind must look like tcp://HOST:PORT, got {ingest_address!r}")
    port = int(m.group("port"))
    return f"tcp://{m.group('host')}:{port + 1 if port else 0}"


def load_buffer_config(
    path: str | None, overrides: list[str]
) -> tuple[BufferConfig, dict[str, Any]]:
    """The ``buffer`` section of a run config file (+ overrides) and the raw mapping."""
    from fleetrl.config import apply_overrides, convert, load_yaml

    raw = load_yaml(path) if path else {}
    raw = apply_overrides(raw, overrides or [])
    return convert(BufferConfig, raw.get("buffer", {}) or {}, prefix="buffer"), raw


def _positive_int(raw: dict[str, Any], section: str, key: str, default: int) -> int:
    from fleetrl.config import ConfigError

    value = (raw.get(section) or {}).get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{section}.{key}", f"got {value!r}; expected an integer >= 1")
    return value


def main(args: argparse.Namespace) -> int:
    """``fleetrl buffer``: serve until interrupted (SIGINT/SIGTERM)."""
    import signal

    config, raw = load_buffer_config(args.config, list(args.overrides or []))
    bank_dir = args.bank_dir or config.bank_dir or "rollout_bank"
    try:
        service = BufferService(
            config,
            ingest_address=args.bind,
            control_address=control_address_for(args.bind),
            bank_dir=bank_dir,
            # B = groups consumed per published version (launcher.config.RunConfig)
            groups_per_version=derive_groups_per_version(
                _positive_int(raw, "data", "train_batch_size", STANDALONE_GROUPS_PER_VERSION),
                _positive_int(raw, "weight_sync", "sync_every", 1),
            ),
            max_concurrent_groups=_positive_int(
                raw, "rollout", "max_concurrent_groups", STANDALONE_MAX_CONCURRENT
            ),
        )
    except (AddressError, InsecureBindError) as err:
        # standalone has no key distribution: off-loopback buffers run under the launcher
        print(f"fleetrl: {err}", file=sys.stderr)
        return 2
    ingest, control = service.start()
    ready_file = getattr(args, "ready_file", None)
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"ingest": ingest, "control": control}))
        tmp.replace(ready_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if service.failure is not None:
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m buffer.service", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--bind", default="tcp://127.0.0.1:5555", help="ingest (PULL) address; control binds port+1"
    )
    parser.add_argument("--bank-dir", default="")
    parser.add_argument("--config", default=None)
    parser.add_argument("--ready-file", default=None, help="write the bound addresses here as JSON")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


if __name__ == "__main__":
    from fleetrl.log import setup_logging

    setup_logging(role="buffer")
    sys.exit(main(_parse(sys.argv[1:])))
