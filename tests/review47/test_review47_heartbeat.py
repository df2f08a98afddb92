"""review47: the heartbeat's remembered intervals, its thread replacement, and the TTL fast path,
on three real loopback masters."""

from __future__ import annotations

import math
import threading
import time

import pytest

from celery_redlock import Lock, Redlock
from celery_redlock.errors import ConfigError
from celery_redlock.lock.heartbeat import Heartbeat, heartbeat_interval, margin, observe_beats
from celery_redlock.testing import ServerSet
from tests.core.conftest import take
from tests.review46.conftest import outlives
from tests.waiting import wait_until


@pytest.mark.timeout(60)
def test_one_heartbeat_shared_by_redlocks_of_different_timing(
    masters47: ServerSet, beat47: Heartbeat
) -> None:
    """Same TTL and interval asked, different request_timeout/drift: each lock gets its own checked
    interval, and an interval valid for one Redlock is refused for the other (never looked up)."""
    for server in masters47:
        server.flushall()
    with (
        Redlock(masters47.urls) as fast,
        Redlock(masters47.urls, request_timeout=0.5, drift_factor=0.2) as slow,
    ):
        a = fast.lock("r47-shared-a", ttl=3.0)
        b = slow.lock("r47-shared-b", ttl=3.0)
        assert a.acquire(blocking=False) and b.acquire(blocking=False)
        try:
            beat47.keep(a, interval=1.5)  # valid: 3 - 0.032 - 0.2 >= 1.5
            with pytest.raises(ConfigError):  # 3 - 0.602 - 1.0 = 1.398 < 1.5
                beat47.keep(b, interval=1.5)
            for _ in range(3):  # and never from the table, however often asked
                with pytest.raises(ConfigError):
                    beat47.keep(b, interval=1.5)
            beat47.keep(a)
            beat47.keep(b)
            assert b._beat == pytest.approx(
                heartbeat_interval(b, None) + margin(heartbeat_interval(b, None), 0.5)
            )
            assert a._beat == pytest.approx(
                heartbeat_interval(a, None) + margin(heartbeat_interval(a, None), 0.1)
            )
            # an int interval equal to a remembered float is the same interval
            beat47.keep(a, interval=1)
            assert a._beat == pytest.approx(1.0 + margin(1.0, 0.1))
            for bad in (True, float("nan"), math.inf, -0.0, 0.0, "1"):
                with pytest.raises(ConfigError):
                    beat47.keep(a, interval=bad)  # type: ignore[arg-type]
            # both stay owned through several beats
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                assert a.owned() and b.owned()
                time.sleep(0.05)
        finally:
            beat47.forget(a)
            beat47.forget(b)
            a.release()
            b.release()


@pytest.mark.timeout(60)
def test_changing_request_timeout_on_a_live_redlock_is_not_looked_up(
    rl47: Redlock, beat47: Heartbeat
) -> None:
    lock = rl47.lock("r47-mutated", ttl=3.0)
    assert lock.acquire(blocking=False)
    try:
        beat47.keep(lock, interval=2.5)  # 3 - 0.032 - 0.2 = 2.768
        rl47.request_timeout = 0.3  # an operator's tuning at run time: 3 - 0.032 - 0.6 < 2.5
        with pytest.raises(ConfigError):
            beat47.keep(lock, interval=2.5)
    finally:
        rl47.request_timeout = 0.1
        beat47.forget(lock)
        lock.release()


@pytest.mark.timeout(60)
def test_ttl_fast_path_near_min_ttl(rl47: Redlock, other47: Redlock) -> None:
    low = rl47.min_ttl
    below = math.nextafter(low, 0.0)
    with pytest.raises(ConfigError):
        rl47.lock("r47-min", ttl=below)
    for bad in (float("nan"), math.inf, -low, 0.0, MAXP := 9.2e15 * 1.0000001):
        with pytest.raises(ConfigError):
            rl47.lock("r47-min", ttl=bad)
    assert MAXP > 9.2e15
    # exactly min_ttl, and an int / a float subclass equal to a valid float, give equal TTLs
    assert rl47.lock("r47-min", ttl=low).ttl == low
    assert rl47.lock("r47-min", ttl=2).ttl == 2.0 and type(rl47.lock("r47-min", ttl=2).ttl) is float
    # A lock at min_ttl: whenever it reports owned, the other client is refused.
    for i in range(30):
        lock = rl47.lock(f"r47-min-{i}", ttl=low)
        if lock.acquire(blocking=False):
            if lock.owned():
                assert not other47.lock(f"r47-min-{i}", ttl=1.0).acquire(blocking=False)
            lock.release()


class LateWaker(threading.Condition):
    """The heartbeat's condition, with the order a race may take made certain: the first thread
    to wait here, once woken, lets its successor go to sleep before it takes the mutex back."""

    def __init__(self, mutex: threading.Lock) -> None:
        super().__init__(mutex)
        self.mutex = mutex
        self.first: threading.Thread | None = None
        self.successor_waits = threading.Event()
        self.back = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        me = threading.current_thread()
        if self.first is None:
            self.first = me
        elif me is not self.first:
            self.successor_waits.set()  # still holding the mutex, which wait() lets go
        woken = super().wait(timeout)
        if me is self.first and not self.back.is_set():
            self.mutex.release()
            self.back.wait(10)
            self.mutex.acquire()
        return woken


@pytest.mark.timeout(60)
def test_a_replaced_thread_waking_late_does_not_hide_its_successors_sleep(rl47: Redlock) -> None:
    """stop(), then keep() before the stopped thread has left its wait: that thread wakes after
    its successor went to sleep, and must not mark the heartbeat awake. Marked awake, keep() no
    longer wakes the successor for an earlier lock, which is then left to expire."""
    beat = Heartbeat(name="review47-late-waker")
    cond = LateWaker(beat._mutex)
    beat._cond = cond  # before the first keep(): every thread of this heartbeat waits on it
    long1, long2 = rl47.lock("r47-late-long1", ttl=30.0), rl47.lock("r47-late-long2", ttl=30.0)
    short = rl47.lock("r47-late-short", ttl=1.5)  # interval 0.5 s, owned 1 s past a missed beat
    assert take(long1) and take(long2) and take(short)
    try:
        beat.keep(long1)  # due in 10 s: the first thread sleeps
        wait_until(lambda: beat._sleep_until > 0, 5, "the first thread's sleep")
        replaced = beat._thread
        assert replaced is not None
        beat.stop(timeout=0.0)
        beat.keep(long2)  # a successor, which sleeps until long2 is due
        assert cond.successor_waits.wait(5), "the successor never went to sleep"
        cond.back.set()  # now the replaced thread takes the mutex back
        replaced.join(5)
        assert not replaced.is_alive()
        assert beat._sleep_until > 0, "the replaced thread marked its sleeping successor awake"
        beat.keep(short)
        outlives(short, seconds=2.5, what="kept while the successor slept until a later lock")
    finally:
        beat.stop()
        for lock in (long1, long2, short):
            lock.release()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("race", [False, True], ids=["control", "stop-and-keep"])
def test_a_lock_rescheduled_by_a_replaced_thread_is_still_extended(masters47: ServerSet, race: bool) -> None:
    """The replaced thread is inside an extension round that fails (two of three masters
    paused, so it runs to request_timeout) when stop() gives up on it and keep() starts a
    successor, which sleeps until a later lock is due. The failed lock's quick retry, queued by
    the replaced thread on its way out, must wake the successor."""
    for server in masters47:
        server.flushall()
    beat = Heartbeat(name="review47-slow-round")
    with Redlock(masters47.urls, request_timeout=0.5) as rl:
        short = rl.lock("r47-slow-short", ttl=3.0)  # interval 1 s
        long = rl.lock("r47-slow-long", ttl=30.0)
        assert take(short) and take(long)
        failed = threading.Event()

        def seen(_lag: float, beats: list[tuple[Lock, float, bool]]) -> None:
            if any(lock is short and not extended for lock, _, extended in beats):
                failed.set()

        observe_beats(seen)
        try:
            beat.keep(short)
            wait_until(lambda: beat._sleep_until > 0, 5, "the first thread's sleep")
            masters47[0].pause()
            masters47[1].pause()
            # Awake for short's beat: its round now waits out request_timeout.
            wait_until(lambda: beat._sleep_until == 0.0, 5, "the thread waking for short's beat")
            first = beat._thread
            assert first is not None
            if race:
                beat.stop(timeout=0.05)  # gives up: the thread is inside the round
            beat.keep(long)
            assert failed.wait(5), "short's extension round did not fail"
            if race:
                first.join(5)  # short's retry queued, it left
                assert not first.is_alive()
        finally:
            observe_beats(None)
            masters47[0].resume()
            masters47[1].resume()
        try:
            outlives(short, seconds=4.0, what="its retry after the failed round")
        finally:
            beat.stop()
            short.release()
            long.release()
            masters47.ensure_running()
