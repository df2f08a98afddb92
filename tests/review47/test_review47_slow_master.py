"""review47: one (or two) of three real masters paused with SIGSTOP: bounds, progress, safety."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.testing import ServerSet
from tests.core.conftest import take

RT = 0.1


@pytest.fixture(scope="module")
def trio() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def clients(trio: ServerSet) -> Iterator[tuple[Redlock, Redlock]]:
    trio.ensure_running()
    for server in trio:
        server.flushall()
    with Redlock(trio.urls, request_timeout=RT) as a, Redlock(trio.urls, request_timeout=RT) as b:
        yield a, b
    trio.ensure_running()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("paused", [0, 1])
def test_release_then_acquire_at_once_is_never_refused(
    trio: ServerSet, clients: tuple[Redlock, Redlock], paused: int
) -> None:
    """With every master up or one paused: another client's acquire, started as release()
    returns, is never refused by a master still holding the released lock. (An attempt that
    failed on late answers alone, a loaded host, is not such a refusal; the bound a silent
    master costs each call is tests/core/test_seams_input.py's.)"""
    a, b = clients
    for i in range(paused):
        trio[i].pause()
    try:
        refused = []
        for i in range(60 if paused else 300):
            mine = a.lock(f"r47-hand-{i % 7}", ttl=30.0)
            assert take(mine), f"iteration {i}: a free lock refused: {mine.last_error}"
            assert mine.release()
            theirs = b.lock(f"r47-hand-{i % 7}", ttl=30.0)
            if theirs.acquire(blocking=False):
                theirs.release()
            elif theirs.last_error is not None and theirs.last_error.held_by_other:
                refused.append((i, str(theirs.last_error)))
        assert not refused, f"refused right after a release: {refused[:5]}"
    finally:
        for i in range(paused):
            trio[i].resume()


@pytest.mark.timeout(120)
def test_kept_lock_survives_a_paused_master_and_stays_exclusive(
    trio: ServerSet, clients: tuple[Redlock, Redlock]
) -> None:
    a, b = clients
    beat = Heartbeat(name="review47-paused")
    lock = a.lock("r47-kept", ttl=1.5)
    assert take(lock)
    try:
        beat.keep(lock)
        trio[0].pause()
        deadline = time.monotonic() + 6.0  # four TTLs
        while time.monotonic() < deadline:
            assert lock.owned(), "a kept lock was lost with 2 of 3 masters up"
            other = b.lock("r47-kept", ttl=1.0)
            assert not other.acquire(blocking=False), "another client took a lock reported owned"
            time.sleep(0.1)
    finally:
        trio[0].resume()
        beat.forget(lock)
        lock.release()
        beat.stop()


@pytest.mark.timeout(120)
def test_quorum_lost_the_holder_is_told_before_anyone_can_take_it(
    trio: ServerSet, clients: tuple[Redlock, Redlock]
) -> None:
    a, b = clients
    beat = Heartbeat(name="review47-noquorum")
    lock = a.lock("r47-noq", ttl=1.5)
    assert take(lock)
    lost_at: list[float] = []
    beat.keep(lock, on_lost=lambda _l, _r: lost_at.append(time.monotonic()))
    trio[0].pause()
    trio[1].pause()
    paused_at = time.monotonic()
    owned_false_at = None
    try:
        while time.monotonic() - paused_at < 3.0:
            if owned_false_at is None and not lock.owned():
                owned_false_at = time.monotonic()
            time.sleep(0.01)
    finally:
        trio[0].resume()
        trio[1].resume()
    # Now another client can take it only once the key expired on a quorum
    other = b.lock("r47-noq", ttl=5.0)
    deadline = time.monotonic() + 5.0
    while not other.acquire(blocking=False):
        assert time.monotonic() < deadline, "never free after the quorum came back"
        time.sleep(0.02)
    taken_at = time.monotonic()
    other.release()
    beat.forget(lock)
    lock.release()
    beat.stop()
    assert owned_false_at is not None and owned_false_at <= taken_at
    assert lost_at and lost_at[0] <= taken_at
