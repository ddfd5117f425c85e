"""Control protocol messages: round trips, header checks, malformed input."""

from __future__ import annotations

import pytest

from buffer.wire import (
    KIND_REQUEST,
    KIND_TRAJECTORY,
    REQUEST_HEADER,
    SCHEMA_VERSION,
    Batch,
    FrameError,
    GetBatch,
    QueryGroups,
    Resume,
    check_header,
    decode_reply,
    decode_request,
    encode,
)


@pytest.mark.parametrize(
    "request_msg",
    [
        GetBatch(num_groups=4, learner_version=3, timeout_ms=100, received_watermark=8),
        Resume(version=2, watermark=16, request_id=9),
        QueryGroups(group_ids=["a", "b"]),
    ],
)
def test_requests_round_trip(request_msg):
    assert decode_request(encode(request_msg)) == request_msg


def test_batch_reply_round_trips_with_its_bytes():
    reply = Batch(
        arrow_ipc=b"\x00" * 10, num_groups=1, num_samples=2, handout_start=5, learner_version=1
    )
    assert decode_reply(encode(reply)) == reply


def test_header_names_the_reason_for_refusal():
    check_header(REQUEST_HEADER, KIND_REQUEST)
    with pytest.raises(FrameError) as bad:
        check_header(b"nope", KIND_REQUEST)
    assert bad.value.reason == "bad_header"
    with pytest.raises(FrameError) as schema:
        check_header(b"FR" + bytes((SCHEMA_VERSION + 1, KIND_REQUEST)), KIND_REQUEST)
    assert schema.value.reason == "wrong_schema"
    with pytest.raises(FrameError) as kind:
        check_header(REQUEST_HEADER, KIND_TRAJECTORY)
    assert kind.value.reason == "wrong_kind"


def test_unknown_op_and_garbage_are_malformed():
    with pytest.raises(FrameError, match="malformed"):
        decode_request(b"\x92\xa4nope\x01")
    with pytest.raises(FrameError, match="malformed"):
        decode_request(b"\xff\xff\xff")
