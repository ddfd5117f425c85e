"""DeliveryLedger: groups are held until the buffer reports them whole; re-sent or re-queued.

Proves, against a real BufferCore (bank on disk) and a real PromptReader:
- trajectories lost in transit (a buffer crash) are re-sent and accepted exactly once;
- prompts in flight at a checkpoint are generated again first after a resume, with the
  same group ids, so the buffer completes partial groups and drops what it already holds.
"""

from __future__ import annotations

import msgspec
import pytest

from buffer.config import BufferConfig
from buffer.core import BufferCore
from buffer.synthetic import make_group
from buffer.transport import InProcessBufferClient
from buffer.wire import decode_trajectory
from fleetrl.data.reader import PromptReader
from fleetrl.data.schema import write_rows
from fleetrl.models.loading import load_tokenizer
from rollout_fleet.delivery import DeliveryLedger, group_id_for

GROUP = 2


class LossySender:
    """Delivers payloads to a BufferCore unless ``dropping`` (the buffer is down)."""

    def __init__(self, core: BufferCore) -> None:
        self.core = core
        self.dropping = False
        self.sent = 0

    def send_payload(self, payload: bytes, timeout_s: float | None = None) -> None:
        self.sent += 1
        if not self.dropping:
            self.core.ingest([decode_trajectory(payload)])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def reader_factory(tmp_path, tokenizer):
    rows = [
        {
            "data_source": "synth/add",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "ability": "synth",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(8)
    ]
    path = write_rows(rows, tmp_path / "train.parquet")
    return lambda: PromptReader([path], tokenizer, max_prompt_length=64, shuffle=False)


def _core(path) -> BufferCore:
    return BufferCore(
        BufferConfig(segment_rows=64), bank_dir=path, groups_per_version=2, max_concurrent_groups=8
    )


def _group_for(prompt):
    return [
        msgspec.structs.replace(t, prompt_index=prompt.index)
        for t in make_group(group_id_for(prompt), GROUP)
    ]


def test_samples_lost_in_a_buffer_crash_are_resent_and_accepted_once(tmp_path, reader_factory):
    core = _core(tmp_path / "bank")
    sender = LossySender(core)
    tracker = DeliveryLedger(reader_factory(), sender, InProcessBufferClient(core), GROUP)
    prompts = tracker.prompts()
    first, second = next(prompts), next(prompts)
    for traj in _group_for(first):
        tracker.send(traj)
    a, b = _group_for(second)
    tracker.send(a)
    sender.dropping = True  # the buffer dies: b vanishes in transit
    tracker.send(b)
    sender.dropping = False
    assert tracker.reconcile() == 1  # p0 confirmed and forgotten, p1 still held

    assert tracker.resend_unconfirmed() == 2  # both samples of p1; the buffer keeps one copy
    assert tracker.reconcile() == 0
    stats = core.stats()
    assert stats["accepted_samples"] == 4
    assert stats["ready_groups"] == 2
    assert stats["duplicates"] == 1
    assert tracker.metrics()["delivery/resent_samples"] == 2


def test_prompts_in_flight_at_a_checkpoint_are_generated_again_first(tmp_path, reader_factory):
    core = _core(tmp_path / "bank")
    tracker = DeliveryLedger(
        reader_factory(), LossySender(core), InProcessBufferClient(core), GROUP
    )
    prompts = tracker.prompts()
    started = [next(prompts) for _ in range(3)]
    for traj in _group_for(started[0]):
        tracker.send(traj)
    tracker.send(_group_for(started[1])[0])  # p1 half sent, p2 still generating
    tracker.reconcile()
    state = msgspec.json.decode(msgspec.json.encode(tracker.state_dict()))  # through meta.json
    assert state["unfinished_prompts"] == [1, 2]

    resumed = DeliveryLedger(
        reader_factory(), LossySender(core), InProcessBufferClient(core), GROUP
    )
    resumed.load_state_dict(state)
    again = resumed.prompts()
    order = [next(again).index for _ in range(3)]
    assert order == [1, 2, 3]  # the unfinished ones, then the cursor where the checkpoint left it
    for traj in _group_for(started[1]) + _group_for(started[2]):
        resumed.send(traj)
    assert resumed.reconcile() == 1  # only p3 (just started) is unconfirmed
    assert core.stats()["accepted_samples"] == 6  # p0, p1, p2 whole; the repeated p1/0 dropped


def test_a_plain_reader_state_from_an_older_checkpoint_still_loads(tmp_path, reader_factory):
    old = reader_factory()
    next(old), next(old)
    core = _core(tmp_path / "bank")
    tracker = DeliveryLedger(
        reader_factory(), LossySender(core), InProcessBufferClient(core), GROUP
    )
    tracker.load_state_dict(old.state_dict())
    assert next(tracker.prompts()).index == 2


def test_a_delivery_state_of_an_unknown_version_is_refused(tmp_path, reader_factory):
    core = _core(tmp_path / "bank")
    tracker = DeliveryLedger(
        reader_factory(), LossySender(core), InProcessBufferClient(core), GROUP
    )
    state = {**tracker.state_dict(), "version": 99}
    with pytest.raises(ValueError, match="delivery state version 99"):
        tracker.load_state_dict(state)
