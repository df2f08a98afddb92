"""FINDING, fixed: a keep() between stop() and the heartbeat thread's exit started a second
thread and cleared the stop, so the first thread never saw it and went on running; stop() then
waited its whole timeout, and later stops woke only one of the two (Condition.notify). Each
thread now runs only while it is the heartbeat's current one, and stop() wakes every waiter.

Made deterministic with a beat observer that holds the running thread inside a beat while
stop() and keep() happen (any extension round slower than stop()'s timeout does the same)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.heartbeat import Heartbeat, observe_beats


@pytest.mark.timeout(60)
def test_keep_between_stop_and_the_thread_exit_leaves_one_thread(rl46: Redlock) -> None:
    beat = Heartbeat(name="review46-stop-race")
    in_beat, let_go = threading.Event(), threading.Event()

    def hold_the_beat(_lag: float, _seen: object) -> None:
        if threading.current_thread().name == "review46-stop-race" and not let_go.is_set():
            in_beat.set()
            let_go.wait(10)

    first = rl46.lock("stop-race-1", ttl=0.6)
    second = rl46.lock("stop-race-2", ttl=0.6)
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    observe_beats(hold_the_beat)
    try:
        beat.keep(first, interval=0.1)
        assert in_beat.wait(5)  # the thread is in a beat, outside the mutex
        beat.stop(timeout=0.2)  # it cannot see the stop yet
        beat.keep(second)  # after stop(): a new thread
        let_go.set()
        # The replaced thread leaves once its beat ends: one thread beats, not two.
        deadline = time.monotonic() + 5
        while len([t for t in threading.enumerate() if t.name == "review46-stop-race"]) != 1:
            assert time.monotonic() < deadline, "the thread keep() replaced after stop() goes on running"
            time.sleep(0.02)
        beat.forget(first)
        beat.forget(second)
        # Nothing is kept: once the forgotten entries' due times pass, both threads wait without
        # a timeout (no event says a thread is blocked in Condition.wait, hence the poll).
        deadline = time.monotonic() + 5
        while not (beat._sleep_until == math.inf and not beat._queue):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        started = time.monotonic()
        beat.stop(timeout=5.0)
        took = time.monotonic() - started
        time.sleep(0.3)
        alive = [t for t in threading.enumerate() if t.name == "review46-stop-race"]
    finally:
        observe_beats(None)
        let_go.set()
        with beat._mutex:  # whatever the outcome, no thread of this test outlives it
            beat._stopping = True
            beat._cond.notify_all()
        for lock in (first, second):
            lock.release()
    assert not alive and took < 2.0, (
        f"{len(alive)} heartbeat thread(s) still running after stop(), which took {took:.1f} s"
    )
