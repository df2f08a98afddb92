"""Lingering releases (``release_linger``): a release waits, at most that long, to go out in the
same write as this process's next command to the masters.

The bound used here is the largest allowed (1 s), so "still there right after release()" and
"gone once the next round returned" hold however slowly a loaded machine schedules us: the
ticker cannot send anything before half the bound has passed.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator

import pytest

from celery_redlock import ConfigError, Redlock
from celery_redlock.testing import ServerSet

from .conftest import keys_on

LINGER = 1.0


@pytest.fixture
def lingering(masters: ServerSet) -> Iterator[Redlock]:
    with Redlock(masters.urls, retry_count=0, release_linger=LINGER) as instance:
        yield instance


def holders(masters: ServerSet, key: str) -> int:
    return sum(1 for keys in keys_on(masters, key).values() if keys)


def wait_gone(masters: ServerSet, key: str, within: float) -> float:
    started = time.monotonic()
    while holders(masters, key) and time.monotonic() - started < within:
        time.sleep(0.01)
    assert holders(masters, key) == 0, f"{key} still on some master after {within} s"
    return time.monotonic() - started


def test_release_lingers_until_the_next_round_carries_it(masters: ServerSet, lingering: Redlock) -> None:
    first = lingering.lock("linger:first", ttl=30)
    assert first.acquire(blocking=False)
    first.release()
    assert not first.owned()
    assert holders(masters, "redlock:linger:first") == 5, "sent at once, not lingering"

    second = lingering.lock("linger:second", ttl=30)
    assert second.acquire(blocking=False)
    # The release went out ahead of the SET on every link, so every master ran it before it
    # answered the SET that this acquire just counted.
    assert holders(masters, "redlock:linger:first") == 0
    assert [vote.kind for vote in second.last_votes] == ["yes"] * 5
    second.release(linger=False)
    wait_gone(masters, "redlock:linger:second", 5.0)


def test_the_same_key_is_free_again_for_its_own_process_at_once(lingering: Redlock) -> None:
    lock = lingering.lock("linger:same", ttl=30)
    for _ in range(3):
        assert lock.acquire(blocking=False), lock.last_error
        lock.release()


def test_an_idle_process_releases_within_the_bound(masters: ServerSet, lingering: Redlock) -> None:
    lock = lingering.lock("linger:idle", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release()
    took = wait_gone(masters, "redlock:linger:idle", LINGER + 2.0)
    assert took >= LINGER / 2 - 0.05, "the ticker sent it before half the bound had passed"


def test_release_without_linger_and_close_send_at_once(masters: ServerSet) -> None:
    with Redlock(masters.urls, retry_count=0, release_linger=LINGER) as rl:
        now = rl.lock("linger:now", ttl=30)
        assert now.acquire(blocking=False)
        now.release(linger=False)
        assert wait_gone(masters, "redlock:linger:now", 5.0) < LINGER / 2
        closing = rl.lock("linger:close", ttl=30)
        assert closing.acquire(blocking=False)
        closing.release()
    # Leaving the with block closed the Redlock, which sent the lingering release.
    assert wait_gone(masters, "redlock:linger:close", 5.0) < LINGER / 2


def _child_acquires(inherited: Redlock, done: multiprocessing.synchronize.Event) -> None:
    # A forked child of a process with a lingering release: its round must not carry it.
    lock = inherited.lock("linger:child", ttl=30)
    if lock.acquire(blocking=False):
        lock.release(linger=False)
        done.set()


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_send_its_parents_lingering_release(
    masters: ServerSet, lingering: Redlock
) -> None:
    lock = lingering.lock("linger:parent", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release()
    context = multiprocessing.get_context("fork")  # the Redlock is inherited, not pickled
    done = context.Event()
    child = context.Process(target=_child_acquires, args=(lingering, done))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and done.is_set(), "the child could not take its own lock"
    # The child's round went to every master; the parent's release was not in it.
    assert holders(masters, "redlock:linger:parent") == 5
    lingering.flush_releases()
    assert wait_gone(masters, "redlock:linger:parent", 5.0) < LINGER / 2


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.02", True])
def test_a_bad_release_linger_is_refused_by_name(masters: ServerSet, value: object) -> None:
    with pytest.raises(ConfigError, match="release_linger"):
        Redlock(masters.urls, release_linger=value)  # type: ignore[arg-type]
