"""BufferService over real ZeroMQ sockets: grouping, long-poll, backpressure, bad input, CURVE."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

from buffer.config import BufferConfig
from buffer.security import make_run_keys
from buffer.synthetic import make_group
from buffer.transport import (
    BufferClient,
    BufferTimeout,
    SendTimeout,
    TrajectorySender,
)
from buffer.wire import REQUEST_HEADER, TRAJECTORY_HEADER, GetStats, encode


def wait_for(condition, limit_s: float = 60.0) -> None:
    """Poll ``condition`` until true; fail (not a speed check) if it never becomes true."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def _group_ids(batch) -> list[str]:
    ids = batch.column("group_id").to_pylist()
    return list(dict.fromkeys(ids))


def test_interleaved_producers_yield_whole_groups_in_completion_order(start_service, zmq_context):
    service = start_service()
    ingest, control = service.addresses
    client = BufferClient(control, timeout_s=10, context=zmq_context)
    a, b = make_group("a", 3), make_group("b", 3)
    with TrajectorySender(ingest, context=zmq_context) as sender:
        for t in [a[0], b[0], b[1], a[1], b[2]]:  # b completes first
            sender.send(t)
        first = client.get_batch(1, learner_version=0, timeout_s=10)
        assert _group_ids(first) == ["b"] and first.num_rows == 3
        assert client.get_batch(1, 0, timeout_s=0.2) is None  # "a" is still partial
        sender.send(a[2])
        assert _group_ids(client.get_batch(1, 0, timeout_s=10)) == ["a"]
    assert client.received_watermark == 2
    assert client.stats()["handout_count"] == 2


def test_a_parked_get_batch_is_answered_when_the_group_completes(start_service, zmq_context):
    service = start_service()
    ingest, control = service.addresses
    client = BufferClient(control, timeout_s=10, context=zmq_context)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(batch=client.get_batch(2, 0, 30)))
    waiter.start()
    with TrajectorySender(ingest, context=zmq_context) as sender:
        for t in make_group("x", 2) + make_group("y", 2):
            sender.send(t)
        waiter.join(30)
    assert _group_ids(result["batch"]) == ["x", "y"]


def test_full_buffer_blocks_producers_and_loses_nothing(start_service, zmq_context):
    """Backpressure: sent = received + in flight at every moment; all arrive once drained."""
    config = BufferConfig(capacity_groups=2, high_water_mark=2, ingest_drain_messages=1)
    service = start_service(config)
    ingest, control = service.addresses
    client = BufferClient(control, timeout_s=10, context=zmq_context)
    total = 48
    trajs = [make_group(f"g{i:03d}", 1, response_len=40_000)[0] for i in range(total)]
    sender = TrajectorySender(ingest, hwm=2, context=zmq_context)
    blocked = threading.Event()
    release = threading.Event()

    def produce() -> None:
        for traj in trajs:
            while True:
                try:
                    sender.send(traj, timeout_s=1.0)
                    break
                except SendTimeout:  # full: never dropped, retried
                    blocked.set()
                    release.wait(60)

    producer = threading.Thread(target=produce)
    producer.start()
    assert blocked.wait(60), "producer never blocked: no backpressure"
    stats = client.stats()
    assert stats["full"] == 1
    in_flight = sender.sent - stats["received_messages"]
    assert in_flight >= 0 and sender.sent < total
    release.set()
    received: list[str] = []
    while len(received) < total:
        batch = client.get_batch(1, 0, timeout_s=30)
        assert batch is not None
        received.extend(batch.column("uid").to_pylist())
    producer.join(30)
    sender.close()
    assert received == [t.uid for t in trajs]  # FIFO, none lost, none repeated
    final = client.stats()
    assert final["received_messages"] == sender.sent == total
    assert final["accepted_samples"] == total and final.get("duplicates", 0) == 0


def _mutations(rng: random.Random, valid: bytes) -> bytes:
    data = bytearray(valid)
    choice = rng.randrange(4)
    if choice == 0:
        return bytes(data[: rng.randrange(len(data))])
    if choice == 1:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if choice == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    return bytes(data) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 50)))


def test_fuzzed_ingest_and_control_frames_are_counted_and_the_service_stays_up(
    start_service, zmq_context
):
    service = start_service()
    ingest, control = service.addresses
    rng = random.Random(1234)
    valid_traj = encode(make_group("v", 2)[0])
    valid_req = encode(GetStats())
    push = zmq_context.socket(zmq.PUSH)
    push.linger = 0
    push.connect(ingest)
    dealer = zmq_context.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(control)
    headers = [TRAJECTORY_HEADER, b"FR\x07\x01", b"\x00", b"FR\x01\x09", b""]
    for i in range(300):
        header = TRAJECTORY_HEADER if i % 2 else rng.choice(headers)
        frames = [header, _mutations(rng, valid_traj)]
        if i % 7 == 0:
            frames = frames[: rng.randrange(3)] or [b""]
        push.send_multipart(frames)
        control_frames = [
            REQUEST_HEADER if i % 2 else rng.choice(headers),
            _mutations(rng, valid_req),
        ]
        dealer.send_multipart(control_frames[: 1 + (i % 5 != 0)])
    client = BufferClient(control, timeout_s=10, context=zmq_context)
    # a good group after the storm is still accepted and served
    with TrajectorySender(ingest, context=zmq_context) as sender:
        for t in make_group("after", 2):
            sender.send(t)
        wait_for(lambda: client.stats()["received_messages"] >= 302)
    batch = client.get_batch(1, 0, timeout_s=10)
    ids = _group_ids(batch)
    assert ids == ["after"] or "after" in _group_ids(client.get_batch(1, 0, timeout_s=10))
    stats = client.stats()
    assert stats["rejected_frames"] > 200
    assert {"rejected_frames.malformed", "rejected_frames.bad_header"} <= set(stats)
    assert stats["rejected_frames.frame_count"] > 0
    assert service.failure is None


def test_oversized_messages_are_dropped_and_counted(start_service, zmq_context):
    service = start_service(BufferConfig(max_message_bytes=64 * 1024))
    ingest, control = service.addresses
    client = BufferClient(control, timeout_s=10, context=zmq_context)
    push = zmq_context.socket(zmq.PUSH)
    push.linger = 0
    push.connect(ingest)
    # each frame under ZMQ_MAXMSGSIZE, the message over the limit: the service's own check
    push.send_multipart([TRAJECTORY_HEADER, b"\x00" * 36_000, b"\x01" * 36_000])
    # one frame over ZMQ_MAXMSGSIZE: ZeroMQ drops the connection before allocating it
    with TrajectorySender(ingest, context=zmq_context) as sender:
        sender.send(make_group("huge", 1, response_len=20_000)[0])
    wait_for(lambda: client.stats().get("rejected_frames.oversized", 0) >= 1)
    with TrajectorySender(ingest, context=zmq_context) as sender:
        for t in make_group("ok", 2):
            sender.send(t)
        assert _group_ids(client.get_batch(1, 0, timeout_s=10)) == ["ok"]
    assert client.group_status(["huge"]) == [0]


def test_curve_admits_only_the_runs_clients(start_service, zmq_context):
    server_keys, (learner_keys, fleet_keys) = make_run_keys(2)
    service = start_service(curve=server_keys)
    ingest, control = service.addresses
    intruder_public, intruder_secret = zmq.curve_keypair()
    from buffer.security import CurveClientKeys

    intruder = CurveClientKeys(intruder_public, intruder_secret, server_keys.public)
    rogue = BufferClient(control, curve=intruder, timeout_s=1.5, context=zmq_context)
    with pytest.raises(BufferTimeout):
        rogue.stats()
    with TrajectorySender(ingest, context=zmq_context, linger_ms=0) as plain:  # no keys at all
        plain.send(make_group("plain", 1)[0])
    with TrajectorySender(ingest, curve=fleet_keys, context=zmq_context) as sender:
        for t in make_group("good", 2):
            sender.send(t)
    client = BufferClient(control, curve=learner_keys, timeout_s=10, context=zmq_context)
    assert _group_ids(client.get_batch(1, 0, timeout_s=10)) == ["good"]
    stats = client.stats()
    assert stats["received_messages"] == 2
    assert stats["curve_refused_clients"] >= 1
