"""ThreadedCalls: calls run on reused worker threads, at most max_workers at once, named while
they run; a timed-out call retires its worker (which exits once the call returns) and the
next call gets a fresh one."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollout_fleet.threaded_call import ThreadedCalls


def test_sequential_calls_reuse_one_thread_named_by_each_call():
    calls = ThreadedCalls(max_workers=4)

    def where(tag: str) -> tuple[int, str, str]:
        return threading.get_ident(), threading.current_thread().name, tag

    async def scenario():
        return [await calls.call(where, {"tag": str(i)}, 5.0, f"reward-{i}") for i in range(20)]

    before = threading.active_count()
    outcomes = asyncio.run(scenario())
    assert [o.value[2] for o in outcomes] == [str(i) for i in range(20)]
    assert {o.value[0] for o in outcomes} == {outcomes[0].value[0]}  # one worker for all
    assert [o.value[1] for o in outcomes] == [f"reward-{i}" for i in range(20)]
    assert all(o.raised is None and o.elapsed_s >= 0 for o in outcomes)
    assert threading.active_count() == before + 1
    calls.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before  # close() let the idle worker end


def test_at_most_max_workers_run_at_once_and_errors_are_returned():
    calls = ThreadedCalls(max_workers=2)
    running, peak, lock = 0, 0, threading.Lock()

    def busy(fail: bool) -> str:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        if fail:
            raise ValueError("user code failed")
        return "ok"

    async def scenario():
        jobs = [calls.call(busy, {"fail": i == 3}, 5.0, f"c{i}") for i in range(6)]
        return await asyncio.gather(*jobs)

    outcomes = asyncio.run(scenario())
    assert peak == 2
    assert [o.value for o in outcomes] == ["ok", "ok", "ok", None, "ok", "ok"]
    assert isinstance(outcomes[3].raised, ValueError)
    calls.close()


def test_a_timed_out_call_retires_its_worker_which_exits_once_the_call_returns():
    calls = ThreadedCalls(max_workers=1)
    release = threading.Event()

    def hangs() -> int:
        release.wait(30)
        return threading.get_ident()

    async def scenario():
        with pytest.raises(TimeoutError):
            await calls.call(hangs, {}, 0.1, "hangs")
        assert calls.num_hung == 1
        # the only slot is free again, and the call runs on a fresh worker
        fresh = await calls.call(threading.get_ident, {}, 5.0, "after")
        return fresh.value

    fresh_ident = asyncio.run(scenario())
    hung_threads = list(calls._abandoned)
    assert len(hung_threads) == 1 and hung_threads[0].ident != fresh_ident
    release.set()
    hung_threads[0].join(5)
    assert not hung_threads[0].is_alive()  # it returned and left instead of waiting for work
    assert calls.num_hung == 0
    calls.close()
