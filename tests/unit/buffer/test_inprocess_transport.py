"""The in-process transport behaves like the ZeroMQ one: backpressure, whole groups, watermarks."""

from __future__ import annotations

import threading

import pytest

from buffer.config import BufferConfig
from buffer.core import BufferCore
from buffer.synthetic import make_group
from buffer.transport import InProcessBufferClient, InProcessSender, SendTimeout
from buffer.wire import Array, WireError


@pytest.fixture
def core(tmp_path):
    return BufferCore(
        BufferConfig(capacity_groups=2),
        bank_dir=tmp_path,
        groups_per_version=1,
        max_concurrent_groups=4,
    )


def test_sender_blocks_while_full_and_resumes_when_drained(core):
    sender = InProcessSender(core)
    client = InProcessBufferClient(core)
    for t in make_group("a", 1) + make_group("b", 1):
        sender.send(t)
    with pytest.raises(SendTimeout):
        sender.send(make_group("c", 1)[0], timeout_s=0.05)
    done = threading.Event()
    producer = threading.Thread(target=lambda: (sender.send(make_group("c", 1)[0]), done.set()))
    producer.start()
    got = [client.get_batch(1, 0, timeout_s=10).column("group_id")[0].as_py() for _ in range(3)]
    producer.join(10)
    assert done.is_set() and got == ["a", "b", "c"]
    assert client.received_watermark == 3
    assert client.state_dict() == {"received_watermark": 3}


def test_get_batch_times_out_with_none_on_a_partial_group(core):
    InProcessSender(core).send(make_group("a", 2)[0])
    assert InProcessBufferClient(core).get_batch(1, 0, timeout_s=0.05) is None


def test_invalid_trajectory_is_refused_before_it_reaches_the_buffer(core):
    t = make_group("a", 1)[0]
    t.token_versions = Array.of([1], "int32")  # one version for an 8-token response
    with pytest.raises(WireError, match="versions"):
        InProcessSender(core).send(t)
