"""Scheduler events reach the HTTP loop in bursts: every ``on_event`` of a recorded
batch runs before the delivery hook, the hook runs once per burst, and the relay wakes
its loop once for any number of queued events, delivering them in order."""

from __future__ import annotations

import asyncio
import threading

import torch

from rollout_fleet.engine.relay import EventRelay
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.sampling import RowSampling
from rollout_fleet.engine.scheduler import Scheduler, Sequence


def test_delivery_hook_runs_once_after_each_burst_of_events(tiny_model_dir):
    torch.set_num_threads(1)
    scheduler = Scheduler(ModelRunner(tiny_model_dir), max_running_requests=8)
    log: list[str] = []
    finished = threading.Event()

    def on_event(seq: Sequence, done: bool) -> None:
        log.append(f"event {seq.rid} {len(seq.output_ids)}")
        if sum(entry.startswith("event") and entry.endswith(" 3") for entry in log) == 4:
            finished.set()

    scheduler.add_delivery_hook(lambda: log.append("hook"))
    seqs = [
        Sequence(
            rid=f"r{i}",
            parent_rid=f"r{i}",
            prompt_ids=[5, 6, 7],
            max_new_tokens=3,
            sampling=RowSampling(temperature=0.0),
            stop_token_ids=frozenset(),
            stop_strings=[],
            on_event=on_event,
            stream=True,
        )
        for i in range(4)
    ]
    scheduler.start()
    try:
        scheduler.submit(seqs).result(10)
        assert finished.wait(30)
    finally:
        scheduler.stop()
    # Three recorded batches (prefill, two decode steps) of four events, each closed by one hook.
    burst = [*(f"event r{i}" for i in range(4)), "hook"]
    expected = []
    for n in (1, 2, 3):
        expected += [f"{e} {n}" if e != "hook" else e for e in burst]
    assert log == expected


def test_relay_wakes_the_loop_once_and_delivers_in_order():
    loop = asyncio.new_event_loop()
    try:
        relay = EventRelay(loop)
        queue: asyncio.Queue = asyncio.Queue()
        wakeups = []
        original = loop.call_soon_threadsafe

        def counting_call_soon_threadsafe(callback, *args):
            wakeups.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting_call_soon_threadsafe  # type: ignore[method-assign]
        relay.wake()  # nothing queued: no wake-up
        for item in range(5):
            relay.put(queue, item)
        relay.wake()
        relay.wake()
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert [queue.get_nowait() for _ in range(5)] == [0, 1, 2, 3, 4]
        relay.put(queue, 5)  # after a drain, the next burst wakes the loop again
        relay.wake()
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert queue.get_nowait() == 5
    finally:
        loop.close()
