"""Fuzzed frames for the soak: a thread that sends malformed messages to both buffer sockets.

Kinds sent, in rotation (each counted):

- ``truncated``: a valid message cut short;
- ``oversized``: a payload just over the buffer's ``max_message_bytes`` (checked by the
  service), and now and then one over ZeroMQ's own limit (the connection is dropped by
  ZeroMQ and reconnects);
- ``wrong_schema``: a header (or a trajectory) carrying another schema version;
- ``random``: random header and payload bytes;
- ``garbage_payload``: a valid header followed by random bytes or by well-formed msgpack
  of the wrong shape;
- ``frame_count``: one frame, or three.

Nothing it sends can decode as a valid trajectory (no bit flips of a valid one, which
could decode into a plausible sample and be trained on): every group id it writes starts
with ``fuzz-`` so the soak can check none was ever accepted. Control replies are read and
discarded, so the buffer never finds this client unreadable. Traffic goes to the
addresses given, which the soak takes from the run's ``buffer_addresses.json``
(loopback). Run by scripts/soak.py; not a library module.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import msgspec
import zmq

from buffer.synthetic import make_trajectory
from buffer.wire import (
    HEADER_MAGIC,
    KIND_REQUEST,
    KIND_TRAJECTORY,
    REQUEST_HEADER,
    TRAJECTORY_HEADER,
    GetStats,
    encode,
)

KINDS = ("truncated", "oversized", "wrong_schema", "random", "garbage_payload", "frame_count")
ZMQ_LIMIT_EVERY = 50  # one oversized message in this many goes past ZeroMQ's own limit


class FrameFuzzer(threading.Thread):
    """Sends about ``rate_per_s`` fuzzed messages a second, alternating the two sockets."""

    def __init__(
        self, ingest: str, control: str, *, rate_per_s: float, max_message_bytes: int, seed: int
    ) -> None:
        super().__init__(name="soak-fuzzer", daemon=True)
        for address in (ingest, control):
            if not address.startswith("tcp://127.0.0.1:"):
                raise ValueError(f"the fuzzer only sends to loopback, not {address}")
        self.ingest, self.control = ingest, control
        self.rate_per_s = rate_per_s
        self.max_message_bytes = max_message_bytes
        self.rng = random.Random(seed)
        self.sent: Counter[str] = Counter()  # "<socket>.<kind>"
        self.would_block = 0
        self.replies = 0
        self._halt = threading.Event()
        traj = make_trajectory("fuzz-valid", 0, 2)
        self._valid = {"ingest": encode(traj), "control": encode(GetStats())}
        # requests carry their schema in the header only; trajectories in both
        self._wrong_schema = encode(msgspec.structs.replace(traj, schema=99, group_id="fuzz-s"))
        self._headers = {"ingest": TRAJECTORY_HEADER, "control": REQUEST_HEADER}
        self._kinds = {"ingest": KIND_TRAJECTORY, "control": KIND_REQUEST}

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        dealer = ctx.socket(zmq.DEALER)
        for sock in (push, dealer):
            sock.linger = 0
            sock.sndhwm = 1000
        push.connect(self.ingest)
        dealer.connect(self.control)
        sockets = {"ingest": push, "control": dealer}
        interval = 1.0 / self.rate_per_s
        next_at = time.monotonic()
        i = 0
        try:
            while not self._halt.is_set():
                target = "ingest" if i % 2 == 0 else "control"
                kind = KINDS[(i // 2) % len(KINDS)]
                frames = self._frames(target, kind, i)
                try:
                    sockets[target].send_multipart(frames, zmq.NOBLOCK)
                    self.sent[f"{target}.{kind}"] += 1
                except zmq.Again:  # the buffer is not reading (backpressure): try later
                    self.would_block += 1
                self._drain(dealer)
                i += 1
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    self._halt.wait(delay)
                elif delay < -1.0:  # fell behind (a loaded machine): do not burst
                    next_at = time.monotonic()
        finally:
            push.close()
            dealer.close()
            ctx.term()

    def _drain(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                dealer.recv_multipart(zmq.NOBLOCK)
                self.replies += 1
            except zmq.Again:
                return

    def _frames(self, target: str, kind: str, i: int) -> list[bytes]:
        rng = self.rng
        header, valid = self._headers[target], self._valid[target]
        if kind == "truncated":
            return [header, valid[: rng.randrange(len(valid))]]
        if kind == "oversized":
            over = self.max_message_bytes + rng.randint(1, 2048)
            if (i // 2) % (ZMQ_LIMIT_EVERY * len(KINDS)) == 1:
                over += 8192  # past ZMQ_MAXMSGSIZE: ZeroMQ drops the connection itself
            return [header, valid + b"\x00" * (over - len(valid))]
        if kind == "wrong_schema":
            if target == "control" or rng.random() < 0.5:
                version = rng.choice((0, 2, 7, 255))
                return [HEADER_MAGIC + bytes((version, self._kinds[target])), valid]
            return [header, self._wrong_schema]
        if kind == "random":
            return [rng.randbytes(rng.randint(0, 8)), rng.randbytes(rng.randint(0, 512))]
        if kind == "garbage_payload":
            if rng.random() < 0.5:
                return [header, rng.randbytes(rng.randint(1, 2048))]
            shape = rng.choice(([1, 2, 3], {"uid": "fuzz-x"}, ["trajectory", 1, "fuzz-y"], "x"))
            return [header, msgspec.msgpack.encode(shape)]
        if rng.random() < 0.5:  # frame_count
            return [header]
        return [header, valid[:-1], rng.randbytes(16)]
