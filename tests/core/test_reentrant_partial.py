"""Partial re-entries and late exits of a reentrant lock, through a slow network (design:
docs/design/waiting.md section 1.4).

Invariants attacked, with three of five masters' proxies delayed past ``request_timeout``:

- a re-entry (``R_ENTER``) granted by 2 of 5 while 3 time out is granted at depth + 1 with the
  validity the holding had: neither renewed (no quorum said yes) nor cut (nobody said ``held``);
- nobody else can take the lock while the owner holds it at any depth, late re-entries and
  exits notwithstanding;
- after the final release, once every delayed command has landed, **no key survives on any
  master**, whether the late ``R_ENTER`` lands before or after the release that deletes the key,
  and a contender then acquires in one round;
- the same when the delay hits the final release itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.clock import now
from celery_redlock.lock.masters import BACKOFF_CAP
from celery_redlock.lock.reentrant import ReentrantLock
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import keys_on, take, take_everywhere, wait_for
from .test_reentrant import counts, in_thread

pytestmark = pytest.mark.timeout(60)

REQUEST_TIMEOUT = 0.1
DELAY = 0.3  # past request_timeout: the delayed masters' replies come late, not never
# Long enough for a release made after the re-entry to overtake it once the network heals.
LONG_DELAY = 1.5
TTL = 5.0
DELAYED = (0, 1, 2)  # three of five: the two that answer in time are no quorum
NAME = "partial"
KEY = "redlock:partial"
# A loaded 2-core machine: how much later than its bound a call may return.
SLACK = 0.2
# A kept exit or release is written on a new link, once a connect succeeds again: the master's
# background retry comes at most BACKOFF_CAP after its last failed connect.
DELIVERED_WITHIN = BACKOFF_CAP + 2 * REQUEST_TIMEOUT + 1.0


@pytest.fixture
def proxied(masters: ServerSet) -> Iterator[tuple[ProxySet, Redlock, Redlock]]:
    """The owner's Redlock through one proxy per master, and a contender's on direct links."""
    with (
        ProxySet([server.address for server in masters], name="partial") as proxies,
        Redlock(proxies.urls, request_timeout=REQUEST_TIMEOUT, retry_count=0) as owner,
        Redlock(masters.urls, request_timeout=0.5, retry_count=0) as contender,
    ):
        yield proxies, owner, contender
        proxies.heal()


def contender_gets_it(contender: Redlock) -> bool:
    """One round by another owner (another thread: the registry is per owner); released at once."""

    def attempt() -> bool:
        lock = contender.lock(NAME, ttl=TTL, reentrant=True)
        got = lock.acquire(blocking=False)
        if got:
            lock.release()
        return bool(got)

    return bool(in_thread(attempt))


def valid_until(lock: ReentrantLock) -> float:
    """When the owner's validity ends, on the lock's clock."""
    return now() + lock.validity


def delay(proxies: ProxySet, direction: str, seconds: float = DELAY) -> None:
    for m in DELAYED:
        proxies[m].delay(seconds, direction)  # type: ignore[arg-type]


def nothing_left(masters: ServerSet) -> bool:
    return all(not keys for keys in keys_on(masters, KEY).values())


def partial_reentry(lock: ReentrantLock) -> None:
    """Re-enter with DELAYED slow: granted, at depth 2, with the validity unchanged."""
    before = valid_until(lock)
    started = now()
    assert take(lock)
    took = now() - started
    inner = lock.holding()
    assert inner is not None
    kinds = [vote.kind for vote in inner.last_votes]
    # The three delayed masters time out; the two others grant, unless a loaded host made one late
    # too: either way a re-entry granted by fewer than a quorum, nobody answering "held".
    assert kinds[:3] == ["timeout"] * 3 and "yes" in kinds[3:] and set(kinds[3:]) <= {"yes", "timeout"}, kinds
    assert lock.depth == 2
    assert lock.owned()
    # Not renewed (2 yes are no quorum) and not cut (nobody answered "held"): the same end.
    assert abs(valid_until(lock) - before) < 0.005, (before, valid_until(lock))
    assert took < REQUEST_TIMEOUT + SLACK, took


@pytest.mark.parametrize("direction", ["up", "down", "both"])
def test_partial_reentry_is_granted_and_harmless(
    masters: ServerSet, proxied: tuple[ProxySet, Redlock, Redlock], direction: str
) -> None:
    """The exits and the final release are made while the three masters are still slow (their
    links owe the late re-entries, so the exits are kept for a new link); the network then
    heals, and everything lands."""
    proxies, owner, contender = proxied
    lock = owner.lock(NAME, ttl=TTL, reentrant=True)
    take_everywhere(lock)  # every master holds it: the counts below are every master's
    delay(proxies, direction)
    partial_reentry(lock)
    assert not contender_gets_it(contender)
    # The late re-entries land: the masters' counts mirror the depth everywhere.
    assert wait_for(lambda: proxies.pending() == 0, 2 * DELAY + 1.0)
    assert wait_for(lambda: counts(masters, KEY) == [[2]] * 5, 1.0), counts(masters, KEY)
    lock.release()
    assert lock.depth == 1
    assert lock.owned()
    assert not contender_gets_it(contender)  # an inner exit never frees the lock
    lock.release()
    assert lock.depth == 0
    assert not lock.owned()
    proxies.heal()
    assert wait_for(lambda: nothing_left(masters), DELIVERED_WITHIN), keys_on(masters, KEY)
    assert contender_gets_it(contender)


@pytest.mark.parametrize("direction", ["up", "both"])
def test_release_overtaking_a_late_reentry_leaves_nothing(
    masters: ServerSet, proxied: tuple[ProxySet, Redlock, Redlock], direction: str
) -> None:
    """The owner leaves at once after the partial re-entry and the network heals long before the
    late R_ENTERs reach the three masters: the final release, written on new links, overtakes
    them (checked: the keys are gone while the R_ENTERs are still held in the proxies). A late
    R_ENTER must then find nothing to enter: it never creates the key."""
    proxies, owner, contender = proxied
    lock = owner.lock(NAME, ttl=TTL, reentrant=True)
    take_everywhere(lock)  # every master holds it: the counts below are every master's
    delay(proxies, direction, LONG_DELAY)
    partial_reentry(lock)
    lock.release()
    lock.release()
    assert lock.depth == 0
    proxies.heal()  # bytes already queued keep their delay; new ones pass at once
    overtaken: list[int] = []

    def released_ahead() -> bool:
        if not nothing_left(masters):
            return False
        overtaken.append(proxies.pending())
        return True

    assert wait_for(released_ahead, LONG_DELAY / 2), keys_on(masters, KEY)
    assert overtaken[-1] > 0, "the late R_ENTERs landed first: the test did not test the overtaking"
    assert wait_for(lambda: proxies.pending() == 0, 2 * LONG_DELAY + 1.0)
    assert nothing_left(masters), keys_on(masters, KEY)
    assert contender_gets_it(contender)


@pytest.mark.parametrize("direction", ["up", "down", "both"])
def test_delayed_final_release_leaves_nothing(
    masters: ServerSet, proxied: tuple[ProxySet, Redlock, Redlock], direction: str
) -> None:
    """The re-entry and the inner exit go through a healthy network; the final release then
    meets three slow masters. It is sent, not waited for, on links that owe nothing, so it lands
    with the delay, and the network need not heal for the key to go."""
    proxies, owner, contender = proxied
    lock = owner.lock(NAME, ttl=TTL, reentrant=True)
    take_everywhere(lock)  # the counts below are every master's
    assert take(lock)
    assert lock.depth == 2
    assert wait_for(lambda: counts(masters, KEY) == [[2]] * 5, 1.0), counts(masters, KEY)
    lock.release()
    assert wait_for(lambda: counts(masters, KEY) == [[1]] * 5, 1.0), counts(masters, KEY)
    assert not contender_gets_it(contender)
    delay(proxies, direction)
    started = now()
    lock.release()
    assert now() - started < REQUEST_TIMEOUT + SLACK  # sent, not waited for
    assert lock.depth == 0
    assert not lock.owned()
    assert wait_for(lambda: proxies.pending() == 0, 2 * DELAY + 1.0)
    assert wait_for(lambda: nothing_left(masters), 1.0), keys_on(masters, KEY)
    assert contender_gets_it(contender)
