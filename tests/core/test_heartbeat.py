"""The heartbeat keeps locks alive for many TTLs and reports the ones it loses."""

from __future__ import annotations

import os
import threading
import time

import pytest

from celery_redlock import ConfigError, Lock, LockLost, Redlock
from celery_redlock.lock.heartbeat import Heartbeat, process_heartbeat
from celery_redlock.testing import ServerSet

from .conftest import take, wait_for


@pytest.fixture
def heartbeat() -> Heartbeat:
    beat = Heartbeat(name="test-heartbeat")
    yield beat  # type: ignore[misc]
    beat.stop()


def test_keeps_a_lock_for_many_ttls(rl: Redlock, heartbeat: Heartbeat) -> None:
    lock = rl.lock("kept", ttl=0.3)
    assert take(lock)
    heartbeat.keep(lock)
    started = time.monotonic()
    contender = rl.lock("kept", ttl=0.3)
    while time.monotonic() - started < 1.5:  # five TTLs
        assert lock.owned()
        assert not contender.acquire(blocking=False)
        time.sleep(0.05)
    heartbeat.forget(lock)
    lock.release()
    assert take(contender)
    contender.release()


def test_reports_a_lost_lock_once(masters: ServerSet, rl: Redlock, heartbeat: Heartbeat) -> None:
    lock = rl.lock("lost", ttl=0.6)
    assert take(lock)
    reasons: list[str] = []
    lost = threading.Event()

    def on_lost(which: Lock, reason: str) -> None:
        assert which is lock
        reasons.append(reason)
        lost.set()

    heartbeat.keep(lock, on_lost=on_lost)
    for server in masters:
        server.flushall()
    assert lost.wait(2.0)
    assert not lock.owned() and "no longer hold" in reasons[0]
    time.sleep(0.3)
    assert len(reasons) == 1 and lock not in heartbeat.kept()


def test_a_passing_fault_does_not_cost_the_lock(
    masters: ServerSet, rl: Redlock, heartbeat: Heartbeat
) -> None:
    lock = rl.lock("blip", ttl=1.5)
    assert take(lock)
    lost = threading.Event()
    heartbeat.keep(lock, interval=0.2, on_lost=lambda _l, _r: lost.set())
    for i in (0, 1, 2):
        masters[i].pause()
    # Extensions fail meanwhile, but the validity has not run out: a kept lock counts as owned
    # for interval + margin (0.2 + 0.5 s) after its last extension began.
    time.sleep(0.3)
    for i in (0, 1, 2):
        masters[i].resume()
    assert wait_for(lambda: lock.validity > 0.5, 3.0)
    assert not lost.is_set() and lock.owned()
    heartbeat.forget(lock)
    lock.release()


def test_max_hold_stops_extending(rl: Redlock, heartbeat: Heartbeat) -> None:
    lock = rl.lock("capped", ttl=0.3)
    assert take(lock)
    lost = threading.Event()
    reasons: list[str] = []
    heartbeat.keep(lock, max_hold=0.5, on_lost=lambda _l, reason: (reasons.append(reason), lost.set()))
    assert lost.wait(3.0)
    assert "max hold" in reasons[0]
    assert not lock.owned()
    # Our validity ends a drift margin before the masters expire the key: poll for it.
    assert rl.lock("capped", ttl=5).acquire(timeout=1.0)


def test_a_capped_holder_is_told_while_its_key_is_still_there(rl: Redlock, heartbeat: Heartbeat) -> None:
    """At max hold the body learns it (owned() False, ensure() raises) before the lock can go:
    the key is still on the masters, so no other client can have taken it yet."""
    lock = rl.lock("capped-told", ttl=3.0)
    assert take(lock)
    lost = threading.Event()
    heartbeat.keep(lock, interval=0.2, max_hold=0.5, on_lost=lambda _l, _r: lost.set())
    assert lost.wait(3.0)
    assert not lock.owned()
    with pytest.raises(LockLost, match="max hold"):
        lock.ensure()
    assert not rl.lock("capped-told", ttl=5).acquire(blocking=False), "the key went before the body was told"
    assert lock.release()  # the token was kept: the release deletes the key
    assert take(rl.lock("capped-told", ttl=5))


def test_released_locks_are_dropped_silently(rl: Redlock, heartbeat: Heartbeat) -> None:
    lock = rl.lock("dropped", ttl=0.3)
    assert take(lock)
    lost = threading.Event()
    heartbeat.keep(lock, on_lost=lambda _l, _r: lost.set())
    lock.release()  # released without forget(): the heartbeat notices the token is gone
    assert wait_for(lambda: lock not in heartbeat.kept(), 2.0)
    assert not lost.is_set()


def test_keep_refuses_a_lock_not_held(rl: Redlock, heartbeat: Heartbeat) -> None:
    with pytest.raises(ValueError, match="not held"):
        heartbeat.keep(rl.lock("never"))


def test_an_interval_checked_for_one_ttl_is_not_taken_for_another(rl: Redlock, heartbeat: Heartbeat) -> None:
    """keep() remembers the intervals it has checked, per TTL: a short lock kept after a long
    one gets its own default interval (a third of its TTL), not the long one's, and outlives
    several of its TTLs."""
    long = rl.lock("remembered-long", ttl=30.0)
    short = rl.lock("remembered-short", ttl=0.4)
    assert take(long) and take(short)
    heartbeat.keep(long)  # default interval 10 s, remembered
    heartbeat.keep(short)
    started = time.monotonic()
    while time.monotonic() - started < 1.4:  # three and a half TTLs of the short lock
        assert short.owned(), "the short lock was kept at the long lock's interval"
        time.sleep(0.05)
    for lock in (short, long):
        heartbeat.forget(lock)
        lock.release()


@pytest.mark.parametrize("bad", [True, float("nan"), 100.0])
def test_a_bad_interval_is_refused_every_time_whatever_was_remembered(
    rl: Redlock, heartbeat: Heartbeat, bad: float
) -> None:
    """A bool equals and hashes like the float it stands for (True like 1.0), and a NaN or a
    too-long interval is never remembered: each is refused at every keep()."""
    fine = rl.lock("remembered-fine", ttl=30.0)
    assert take(fine)
    heartbeat.keep(fine, interval=1.0)  # 1.0 is remembered for this TTL
    for attempt in range(2):
        lock = rl.lock(f"remembered-bad-{attempt}", ttl=30.0)
        assert take(lock)
        with pytest.raises(ConfigError, match="interval"):
            heartbeat.keep(lock, interval=bad)
        assert lock not in heartbeat.kept()
        lock.release()
    heartbeat.forget(fine)
    fine.release()


def test_a_forked_child_gets_its_own_heartbeat() -> None:
    parent = process_heartbeat()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read)
        child = process_heartbeat()
        os.write(write, b"1" if child is not parent else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"


@pytest.mark.timeout(30)
def test_a_kept_lock_its_owner_finds_lost_first_is_announced_once(
    masters: ServerSet, heartbeat: Heartbeat
) -> None:
    """The owner sees the loss (its validity ran out while the heartbeat's round hangs on
    paused masters) and forgets the lock before that round ends: the loss is still announced,
    by forget(), and not a second time when the round ends."""
    calls: list[str] = []
    with Redlock(masters.urls, retry_count=0, request_timeout=0.5) as rl:
        lock = rl.lock("owner-first", ttl=2.0)
        assert take(lock)
        heartbeat.keep(lock, on_lost=lambda _lock, reason: calls.append(reason))
        for server in masters:
            server.pause()  # every extension round from now on hangs its whole request timeout
        try:
            assert wait_for(lambda: not lock.owned(), 5)
            with pytest.raises(LockLost):
                lock.ensure()
            heartbeat.forget(lock)
            # Announced by forget(), or (rarely: a round ending within the owner's poll) by the
            # heartbeat just before: either way once. The heartbeat's thread claims the callback
            # before it calls it, and on a loaded host it may not have run between the two yet
            # (forget() does not wait for it: a callback that forgets its lock would deadlock).
            assert wait_for(lambda: len(calls) == 1, 5), calls
        finally:
            for server in masters:
                server.resume()
        time.sleep(rl.request_timeout + 0.5)  # the hung round has ended, and found it lost
        assert len(calls) == 1, calls


class NotedLock(Lock):
    """A lock whose every successful extension sets ``extended_once`` (the hook a subclass has)."""

    def __init__(self, redlock: Redlock, name: str, ttl: float) -> None:
        super().__init__(redlock, name, ttl)
        self.extended_once = threading.Event()

    def extended(self, ttl: float) -> None:
        self.extended_once.set()


@pytest.mark.timeout(40)
def test_a_lock_lost_while_the_heartbeat_is_held_up_elsewhere_is_announced_by_forget(
    masters: ServerSet, heartbeat: Heartbeat
) -> None:
    """The heartbeat's one thread is inside another lock's extension round, hung on paused
    masters (for up to 8 s), when this lock's validity runs out: only forget() can announce the
    loss, at once and in the owner's thread; the heartbeat, back from its round, does not again."""
    calls: list[str] = []
    with (
        Redlock(masters.urls, retry_count=0, request_timeout=8.0) as slow,
        Redlock(masters.urls, retry_count=0, request_timeout=0.5) as rl,
    ):
        blocker = NotedLock(slow, "held-up-blocker", ttl=30.0)
        lock = rl.lock("held-up", ttl=2.0)
        assert take(blocker) and take(lock)
        for server in masters:
            server.pause()  # the blocker's first round, due in 0.2 s, hangs until they resume
        try:
            heartbeat.keep(blocker, interval=0.2)
            heartbeat.keep(lock, on_lost=lambda _lock, reason: calls.append(reason))
            assert wait_for(lambda: not lock.owned(), 5)
            with pytest.raises(LockLost):
                lock.ensure()
            assert calls == [], "the heartbeat was to be held up in the blocker's round"
            assert not blocker.extended_once.is_set()
            heartbeat.forget(lock)
            assert len(calls) == 1, calls
        finally:
            for server in masters:
                server.resume()
        # The blocker's round ends as the masters answer, and the thread runs on: the lock it
        # would have found lost is forgotten, and is announced no second time.
        assert blocker.extended_once.wait(10), "the blocker's round never ended"
        assert wait_for(lambda: len(calls) > 1, 1.5) is False, calls
        heartbeat.forget(blocker)
