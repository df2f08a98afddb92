"""AsyncRedlock under network faults, through the loopback proxy (celery_redlock.testing.proxy),
as the threaded core's fault tests do: a master whose replies are late, links reset mid-round, a
release whose bytes are thrown away, and a listening link cut under a waiter."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from celery_redlock import AsyncRedlock
from celery_redlock.testing import ProxySet, ServerSet
from tests.waiting import wait_for

from .conftest import ROUND_SLACK, keys_on, run, take

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def proxies(masters: ServerSet) -> Iterator[ProxySet]:
    with ProxySet([server.address for server in masters]) as group:
        yield group


async def _until(check: object, seconds: float) -> bool:
    """Poll ``check()`` every 20 ms for up to ``seconds``; whether it came true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.02)
    return bool(check())  # type: ignore[operator]


def test_a_master_with_late_replies_bounds_every_round_and_keeps_no_key(
    masters: ServerSet, proxies: ProxySet
) -> None:
    async def main() -> list[float]:
        took = []
        async with AsyncRedlock(proxies.urls, ttl=10.0, request_timeout=0.2) as rl:
            warm = rl.lock("warm")
            assert await take(warm)  # every link made
            await warm.release()
            proxies[0].delay(0.5, "down")  # its replies come after every round's deadline
            for _ in range(3):
                lock, other = rl.lock("late"), rl.lock("late")
                started = time.monotonic()
                got = await lock.acquire(blocking=False)
                acquiring = time.monotonic() - started
                # Bounded, granted or not; refused only for a healthy master's answer late on
                # a loaded host, it is asked again (untimed) for the rest's premise.
                assert got or await take(lock), lock.last_error
                started = time.monotonic()
                assert not await other.acquire(blocking=False)  # exclusion holds meanwhile
                assert await lock.release()  # a quorum answered: not waited for the late one
                took.append(acquiring + time.monotonic() - started)
            proxies[0].heal()
            # The late master applied SET then the release (one link, in order): nothing left.
            assert await _until(lambda: keys_on(masters) == [[]] * 5, 3.0), keys_on(masters)
        return took

    took = run(main())
    # acquire and the refused attempt wait out the late master (0.2 s each); the release does not.
    assert all(t < 2 * 0.2 + ROUND_SLACK for t in took), took


def test_links_reset_mid_round_cost_a_minority_nothing_and_are_made_again(
    masters: ServerSet, proxies: ProxySet
) -> None:
    async def main() -> tuple[list[str], list[str]]:
        async with AsyncRedlock(proxies.urls, ttl=10.0, request_timeout=0.3, retry_count=0) as rl:
            lock = rl.lock("reset")
            assert await take(lock)
            proxies[1].cut()  # both links reset under the held lock
            proxies[2].cut()
            assert await lock.extend()  # a quorum of three still answers
            during = [v.kind for v in lock.last_votes]
            assert await lock.release()
            proxies[1].heal()
            proxies[2].heal()
            await asyncio.sleep(0.1)  # past the connect backoff's floor
            again = rl.lock("reset")
            for _ in range(20):  # reconnects come back within the backoff (at most 1 s)
                assert await take(again)
                after = [v.kind for v in again.last_votes]
                await again.release()
                if after == ["yes"] * 5:
                    break
                await asyncio.sleep(0.1)
            return during, after

    during, after = run(main())
    assert during.count("yes") == 3 and during[1] != "yes" and during[2] != "yes"
    assert after == ["yes"] * 5
    # A release returns once a quorum applied it; the other masters' replies are on their way.
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_a_release_whose_bytes_are_dropped_is_delivered_once_the_link_is_back(
    masters: ServerSet, proxies: ProxySet
) -> None:
    async def main() -> None:
        async with AsyncRedlock(proxies.urls, ttl=30.0, request_timeout=0.2) as rl:
            lock = rl.lock("dropped")
            assert await take(lock)
            proxies[4].drop()  # the release to this master is thrown away
            assert await lock.release()  # four of five answered
            assert keys_on(masters)[4] != []
            proxies[4].heal()  # its stream reset: the kept release goes out on a new link
            assert await _until(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)

    run(main())


def test_a_waiter_whose_listening_link_is_cut_still_gets_the_lock(
    masters: ServerSet, proxies: ProxySet
) -> None:
    async def main() -> tuple[bool, int]:
        async with AsyncRedlock(proxies.urls, ttl=10.0, wait_poll=0.5) as rl:
            held = rl.lock("deaf")
            assert await take(held)
            waiting = asyncio.create_task(rl.lock("deaf").acquire(timeout=10))
            await asyncio.sleep(0.3)
            for proxy in proxies:
                proxy.cut()  # every link reset, the listening ones too
            await asyncio.sleep(0.1)
            for proxy in proxies:
                proxy.heal()
            await held.release()  # may find no link for a moment: kept, and delivered
            got = await asyncio.wait_for(waiting, 8)
            listening = await _until(lambda: rl.subscriber.listening() == 5, 3.0)
            return got, rl.subscriber.listening() if listening else -1

    got, listening = run(main())
    assert got and listening == 5
