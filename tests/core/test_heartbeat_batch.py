"""The heartbeat extends every due lock of a process in one round per master, so many held locks
behind slow masters are all kept alive.

Extending one lock per round trip, a process holding 60 locks with a 1 s TTL behind masters
~40 ms away needs 2.4 s per pass over its locks, against an interval of 0.33 s: it falls behind
and locks expire while every master is healthy. Pipelined, a pass is one round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from celery_redlock import Lock, Redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import take, values_on, wait_for

pytestmark = pytest.mark.timeout(60)

LOCKS = 60
TTL = 1.0
ONE_WAY = 0.02  # added by every proxy in each direction: a round trip of ~40 ms
REQUEST_TIMEOUT = 0.2  # far above the round trip, and leaves a 1 s TTL room for a missed round


@pytest.fixture
def proxies(masters: ServerSet) -> Iterator[ProxySet]:
    with ProxySet(server.address for server in masters) as proxy_set:
        yield proxy_set


@pytest.fixture
def heartbeat() -> Iterator[Heartbeat]:
    beat = Heartbeat(name="test-heartbeat-batch")
    yield beat
    beat.stop()


def test_sixty_locks_behind_slow_masters_are_all_kept(
    masters: ServerSet, proxies: ProxySet, heartbeat: Heartbeat
) -> None:
    with Redlock(proxies.urls, request_timeout=REQUEST_TIMEOUT, retry_count=0) as rl:
        locks = [rl.lock(f"batch-{n}", ttl=TTL) for n in range(LOCKS)]
        for lock in locks:
            assert take(lock), lock.last_error
        lost: list[str] = []
        reported = threading.Lock()

        def on_lost(lock: Lock, reason: str) -> None:
            with reported:
                lost.append(f"{lock.name}: {reason}")

        for lock in locks:
            heartbeat.keep(lock, on_lost=on_lost)
        for proxy in proxies:
            proxy.delay(ONE_WAY, "both")

        started = time.monotonic()
        while time.monotonic() - started < 3 * TTL:
            not_owned = [lock.name for lock in locks if not lock.owned()]
            assert not not_owned and not lost, f"{len(not_owned)} not owned, lost: {lost}"
            time.sleep(0.05)

        # Held on the masters themselves, by the token each lock holds: read while the heartbeat
        # still keeps them (once it is stopped, a 1 s TTL is shorter than these reads on a
        # loaded host).
        for lock in locks[:: LOCKS // 6]:
            held = [value for value in values_on(masters, lock.key).values() if value is not None]
            assert len(held) >= rl.quorum and all(v == lock.token.encode() for v in held)  # type: ignore[union-attr]
        proxies.heal()
        for lock in locks:
            heartbeat.forget(lock)
            lock.release()


def test_extend_many_is_one_round_trip_and_keeps_each_locks_rules(
    masters: ServerSet, proxies: ProxySet
) -> None:
    one_way = 0.05
    with Redlock(proxies.urls, request_timeout=1.0, retry_count=0) as rl:
        locks = [rl.lock(f"many-{n}", ttl=5) for n in range(20)]
        for lock in locks:
            assert take(lock), lock.last_error
        # Lock 3 is taken from a majority of the masters by deleting its key there: its
        # extension must fail and mark it lost, while the others are renewed.
        for server in masters[:3]:
            client = server.client()
            try:
                client.delete(locks[3].key)
            finally:
                client.close()
        never_acquired = rl.lock("many-never")
        # Let the validities run down, so a renewed one is told from one left alone.
        assert wait_for(lambda: all(lock.validity < 4.7 for lock in locks), 2.0)
        for proxy in proxies:
            proxy.delay(one_way, "both")

        started = time.monotonic()
        results = rl.extend_many([*locks, never_acquired, locks[0]])
        elapsed = time.monotonic() - started
        proxies.heal()

        assert elapsed < 4 * one_way, f"{elapsed * 1000:.0f} ms: not one round trip"
        assert results == [n != 3 for n in range(20)] + [False, True]
        assert not locks[3].owned() and "no longer hold" in locks[3].lost_reason
        assert all(lock.validity > 4.8 for n, lock in enumerate(locks) if n != 3)
        for lock in locks:
            lock.release()
