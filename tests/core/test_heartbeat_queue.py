"""The heartbeat's queue stays cheap under churn, and one round costs one timeout.

A worker keeps and forgets a lock per task: keep() must not wake the heartbeat thread each time,
forgotten entries must not pile up (nor keep their owners' callbacks alive), and a lock due
before the sleeping thread would wake must still wake it. A round to N masters reads the replies
in order against one deadline, so silent masters cost one request_timeout together, not each.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

from celery_redlock import Lock, Redlock
from celery_redlock.lock.heartbeat import COMPACT_SLACK, Heartbeat
from celery_redlock.testing import ServerSet

from .conftest import keys_on, take, wait_for

pytestmark = pytest.mark.timeout(60)


class CountingCondition(threading.Condition):
    """A Condition that counts notify() calls (keep() waking the thread) and wait() calls (the
    thread going back to sleep, once per wake-up)."""

    def __init__(self, mutex: threading.Lock) -> None:
        super().__init__(mutex)
        self.notifies = 0
        self.waits = 0

    def notify(self, n: int = 1) -> None:
        self.notifies += 1  # called holding the condition
        super().notify(n)

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


class OnLost:
    """An on_lost callback that can be weakly referenced (a plain function lives on in its code)."""

    def __call__(self, lock: Lock, reason: str) -> None:  # pragma: no cover - never lost here
        raise AssertionError(f"{lock.name} reported lost: {reason}")


@pytest.fixture(scope="module")
def three() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def rl3(three: ServerSet) -> Iterator[Redlock]:
    three.ensure_running()
    with Redlock(three.urls, retry_count=0) as instance:
        yield instance


@pytest.fixture
def heartbeat() -> Iterator[Heartbeat]:
    beat = Heartbeat(name="test-heartbeat-queue")
    yield beat
    beat.stop()


def test_keep_does_not_wake_the_thread_per_lock(rl3: Redlock, heartbeat: Heartbeat) -> None:
    # Over the heartbeat's own mutex, which keep() and forget() take (not the condition's
    # __enter__): set before the first keep(), so the thread only ever sees this one.
    cond = CountingCondition(heartbeat._mutex)
    heartbeat._cond = cond
    keeps = 300
    for n in range(keeps):
        lock = rl3.lock(f"churn-{n}", ttl=30)  # due in 10 s: the thread never has to wake
        assert take(lock)
        heartbeat.keep(lock)
        heartbeat.forget(lock)
        lock.release()
    with cond:
        notifies, waits = cond.notifies, cond.waits
        running = heartbeat._running
    assert running
    assert notifies <= 5, f"{notifies} notifies for {keeps} keep() calls"
    assert waits <= 5, f"the thread went to sleep {waits} times for {keeps} keep() calls"


def test_forgotten_entries_do_not_pile_up(rl3: Redlock, heartbeat: Heartbeat) -> None:
    live = [rl3.lock(f"live-{n}", ttl=30) for n in range(3)]
    for lock in live:
        assert take(lock)
        heartbeat.keep(lock)
    churn = rl3.lock("churn", ttl=30)
    assert take(churn)

    # The first forgotten entry sits in the queue (far from compaction), yet lets go of its
    # callback at once.
    callback: OnLost | None = OnLost()
    first = weakref.ref(callback)
    heartbeat.keep(churn, on_lost=callback)
    heartbeat.forget(churn)
    with heartbeat._cond:
        assert len(heartbeat._queue) == len(live) + 1
    del callback
    gc.collect()
    assert first() is None, "a forgotten entry still holds its on_lost callback"

    refs = []
    largest = 0
    bound = 2 * len(live) + COMPACT_SLACK + 1
    for _ in range(1000):
        callback = OnLost()
        refs.append(weakref.ref(callback))
        heartbeat.keep(churn, on_lost=callback)
        heartbeat.forget(churn)
        with heartbeat._cond:
            largest = max(largest, len(heartbeat._queue))
    del callback
    assert largest <= bound, f"the queue grew to {largest} entries for {len(live)} live locks"
    gc.collect()
    alive = sum(1 for ref in refs if ref() is not None)
    assert alive == 0, f"{alive} forgotten on_lost callbacks are still referenced"
    assert set(heartbeat.kept()) == set(live)

    for lock in live:
        heartbeat.forget(lock)
        lock.release()
    churn.release()


def test_a_lock_due_earlier_wakes_the_sleeping_thread(rl3: Redlock, heartbeat: Heartbeat) -> None:
    slow = rl3.lock("slow", ttl=30)
    assert take(slow)
    heartbeat.keep(slow, interval=10)
    heartbeat.forget(slow)
    # The thread sleeps towards the forgotten lock's due time, ten seconds away.
    assert wait_for(lambda: heartbeat._sleep_until > time.monotonic() + 5, 2.0)

    fast = rl3.lock("fast", ttl=1.5)  # extended every 0.5 s
    assert take(fast)
    acquired_at = time.monotonic()
    first_validity = fast.validity
    heartbeat.keep(fast)

    def renewed() -> bool:
        # Without an extension the validity only runs down from what the acquire gave (and
        # stays at 0 once run out, hence the floor).
        unextended = max(0.0, first_validity - (time.monotonic() - acquired_at))
        return fast.validity > unextended + 0.2

    assert wait_for(renewed, 3.0), "the lock due first was never extended"
    contender = rl3.lock("fast", ttl=1.5)
    while time.monotonic() - acquired_at < 2.5:  # longer than its TTL
        assert fast.owned()
        assert not contender.acquire(blocking=False)
        time.sleep(0.05)
    assert fast.owned()
    heartbeat.forget(fast)
    fast.release()
    slow.release()


REQUEST_TIMEOUT = 0.3
SLACK = 0.25


@pytest.mark.parametrize("paused", [(0,), (0, 1)], ids=["first-paused", "first-two-paused"])
def test_silent_masters_cost_one_timeout_together(masters: ServerSet, paused: tuple[int, ...]) -> None:
    rl = Redlock(masters.urls, request_timeout=REQUEST_TIMEOUT, retry_count=0)
    # Every link made while all masters answer (the usual steady state), nothing owed on them.
    assert rl.read_everywhere("warm-up") == [None] * len(masters)
    lock = rl.lock("ordered", ttl=10)
    try:
        for i in paused:
            masters[i].pause()
        started = time.monotonic()
        acquired = lock.acquire(blocking=False)
        elapsed = time.monotonic() - started
        kinds = [vote.kind for vote in lock.last_votes]
        assert acquired, kinds
        # The silent ones time out and the rest are still read against the same deadline: a
        # quorum of them granted (what "acquired" promises; one a loaded host made late may not).
        assert kinds[: len(paused)] == ["timeout"] * len(paused), kinds
        assert kinds.count("yes") >= rl.quorum and "held" not in kinds and "error" not in kinds, kinds
        assert elapsed < REQUEST_TIMEOUT + SLACK, f"{elapsed:.3f} s with {len(paused)} silent"
    finally:
        for i in paused:
            masters[i].resume()
    try:
        # The late SETs land after the resume; the retraction queued behind each removes it,
        # while the lock is still held on the masters that granted it.
        silent = {masters[i].address for i in paused}

        def on_silent() -> list[bytes]:
            return [
                key
                for address, keys in keys_on(masters, lock.key).items()
                if address in silent
                for key in keys
            ]

        assert wait_for(lambda: not on_silent(), 3.0), on_silent()
        assert lock.owned()
        lock.release()
        assert wait_for(lambda: not any(keys_on(masters, lock.key).values()), 3.0), keys_on(masters, lock.key)
    finally:
        lock.release()
        rl.close()
