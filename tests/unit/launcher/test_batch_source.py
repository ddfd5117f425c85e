"""Learner rank 0's batch source: at most one batch held until a step takes it, and a
checkpoint taken while one is held records the hand-outs before it (a resumed run serves the
held batch again instead of skipping it)."""

from __future__ import annotations

import pytest

from buffer.transport import BatchInfo, BufferControl


class _Client:
    """The buffer's control client as the batch source uses it: batches of 4 hand-outs."""

    def __init__(self, ready: int) -> None:
        self.ready = ready  # batches the buffer can hand out
        self.received_watermark = -1
        self.last_batch = None
        self.asked = 0

    def get_batch(self, num_groups, version, timeout_s):
        self.asked += 1
        if not self.ready:
            return None
        self.ready -= 1
        start = max(self.received_watermark, 0)
        self.last_batch = BatchInfo(start, num_groups, num_groups * 8, version, 0)
        self.received_watermark = start + num_groups
        return f"batch@{start}"

    state_dict = BufferControl.state_dict


def test_a_held_batch_is_taken_once_and_fetched_once():
    from launcher.batch_source import BatchSource

    client = _Client(ready=2)
    source = BatchSource(client)
    assert source.wait(4, 0, 0.1) and source.wait(4, 0, 0.1)
    assert client.asked == 1  # held: not fetched again
    assert source.take() == "batch@0"
    with pytest.raises(RuntimeError, match="without a batch held"):
        source.take()


def test_checkpoint_state_leaves_out_a_held_batch():
    from launcher.batch_source import BatchSource

    client = _Client(ready=2)
    source = BatchSource(client)
    assert source.state_dict() == {"received_watermark": 0}
    source.wait(4, 0, 0.1)
    source.take()  # trained: counted
    assert source.state_dict() == {"received_watermark": 4}
    source.wait(4, 1, 0.1)  # the next step's batch, fetched ahead: not trained yet
    assert client.received_watermark == 8 and source.state_dict() == {"received_watermark": 4}
    source.take()
    assert source.state_dict() == {"received_watermark": 8}
    assert not source.wait(4, 2, 0.1)  # nothing ready: nothing held, nothing left out
    assert source.state_dict() == {"received_watermark": 8}
