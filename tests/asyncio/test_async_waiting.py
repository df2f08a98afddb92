"""Waiting woken by the release, for asyncio: a waiter wakes on the holder's release (not on a
poll), on an abandoned lock's expiry, in arrival order when fair; a refusal names the holder.

Every test sets ``wait_poll`` and ``retry_delay`` far above what it measures (``SLOW``), so only
a notice (or the expiry the refusals reported) can explain a quick wake-up."""

from __future__ import annotations

import asyncio
import time

import pytest

from celery_redlock import AsyncRedlock, LockNotAcquired
from celery_redlock.testing import ServerSet

from .conftest import SLOW, WOKEN_BY_NOTICE, keys_on, run, take

pytestmark = pytest.mark.timeout(30)


def test_a_waiter_is_woken_by_the_release(masters: ServerSet) -> None:
    async def main() -> tuple[float, int]:
        async with (
            AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as holder_rl,
            AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as waiter_rl,
        ):
            held = holder_rl.lock("woken")
            assert await take(held)
            waiting = asyncio.create_task(waiter_rl.lock("woken").acquire(timeout=8))
            await asyncio.sleep(0.5)  # it joined the room, tried again, and sleeps
            listening = waiter_rl.subscriber.listening()
            assert await held.release()
            released = time.monotonic()
            assert await waiting
            return time.monotonic() - released, listening

    took, listening = run(main())
    assert listening == 5
    assert took < WOKEN_BY_NOTICE, took  # a poll would come seconds after the release
    assert keys_on(masters) != [[]] * 5  # the waiter holds it (never released here)


def test_many_waiters_take_turns_quickly_and_never_overlap(masters: ServerSet) -> None:
    inside = 0
    most = 0
    turns = 0

    async def worker(rl: AsyncRedlock) -> None:
        nonlocal inside, most, turns
        for _ in range(3):
            async with rl.lock("turns", timeout=20):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                inside -= 1
                turns += 1

    async def main() -> float:
        async with (
            AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as one,
            AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as two,
        ):
            started = time.monotonic()
            await asyncio.gather(*(worker(one if k % 2 else two) for k in range(8)))
            return time.monotonic() - started

    took = run(main())
    assert most == 1 and turns == 24
    # 24 holds of 10 ms; a polling waiter would wait up to seconds per turn.
    assert took < 5.0, took
    assert keys_on(masters) == [[]] * 5


def test_an_abandoned_lock_wakes_its_waiter_when_it_expires(masters: ServerSet) -> None:
    async def main() -> float:
        async with AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as rl:
            gone = rl.lock("abandoned", ttl=0.6)
            assert await take(gone)
            gone._token = None  # its holder vanished without a release (a crashed process)
            started = time.monotonic()
            assert await rl.lock("abandoned").acquire(timeout=8)
            return time.monotonic() - started

    took = run(main())
    assert took < 0.6 + 0.3, took  # woken when the refusals' PTTLs said, not by a poll


def test_fair_waiters_take_the_lock_in_arrival_order(masters: ServerSet) -> None:
    async def main() -> list[int]:
        order: list[int] = []
        async with AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as rl:
            held = rl.lock("queue", fair=True)
            assert await take(held)

            async def waiter(k: int) -> None:
                async with rl.lock("queue", fair=True, timeout=15):
                    order.append(k)
                    await asyncio.sleep(0.02)

            tasks = []
            for k in range(4):
                tasks.append(asyncio.create_task(waiter(k)))
                await asyncio.sleep(0.2)  # each has probed and joined before the next arrives
            started = time.monotonic()
            await held.release()
            await asyncio.gather(*tasks)
            assert time.monotonic() - started < 3.0
        return order

    assert run(main()) == [0, 1, 2, 3]
    assert keys_on(masters) == [[]] * 5


def test_wait_poll_mode_still_polls(masters: ServerSet) -> None:
    async def main() -> bool:
        async with AsyncRedlock(masters.urls, ttl=10.0, wait="poll", retry_delay=0.05) as rl:
            held = rl.lock("polled")
            assert await take(held)
            waiting = asyncio.create_task(rl.lock("polled").acquire(timeout=5))
            await asyncio.sleep(0.2)
            assert rl.subscriber.listening() == 0  # no listening link in poll mode
            await held.release()
            return await waiting

    assert run(main())


def test_a_refusal_names_the_holder(masters: ServerSet) -> None:
    async def main() -> LockNotAcquired:
        async with (
            AsyncRedlock(masters.urls, ttl=10.0, retry_delay=0.05) as rl,
            rl.lock("named", holder="report-builder"),
        ):
            with pytest.raises(LockNotAcquired) as caught:
                async with rl.lock("named", timeout=0.3):
                    pass
            assert await rl.holder("named") == "report-builder"
            assert await rl.holder("nobody") is None
            return caught.value

    error = run(main())
    assert error.holder == "'report-builder'"
    assert "held by 'report-builder'" in str(error)


def test_a_cancelled_waiter_leaves_its_room_and_aclose_ends_the_listeners(masters: ServerSet) -> None:
    async def main() -> set[asyncio.Task[object]]:
        rl = AsyncRedlock(masters.urls, ttl=10.0, **SLOW)
        held = rl.lock("left")
        assert await take(held)
        waiting = asyncio.create_task(rl.lock("left").acquire(timeout=8))
        await asyncio.sleep(0.3)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert all(not room.waiters for room in rl.subscriber._rooms.values())
        await held.release()
        await rl.aclose()
        assert rl.subscriber.listening() == 0
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert run(main()) == set()
    assert keys_on(masters) == [[]] * 5


def test_a_reentrant_waiter_is_woken_by_the_release(masters: ServerSet) -> None:
    async def main() -> tuple[float, int]:
        async with AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as rl:
            held = rl.lock("re-woken", reentrant=True)
            assert await take(held)

            async def other() -> bool:  # another task: not the holder, so it waits
                lock = rl.lock("re-woken", reentrant=True)
                got = await lock.acquire(timeout=8)
                depth = lock.depth
                await lock.release()
                return got and depth == 1

            waiting = asyncio.create_task(other())
            await asyncio.sleep(0.5)
            assert await held.release()
            released = time.monotonic()
            assert await waiting
            return time.monotonic() - released, rl.subscriber.listening()

    took, listening = run(main())
    assert listening == 5 and took < WOKEN_BY_NOTICE, took  # a poll would come seconds after
    assert keys_on(masters) == [[]] * 5
