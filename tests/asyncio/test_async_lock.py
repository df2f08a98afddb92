"""AsyncRedlock's contract on real masters: exclusion, quorum, release, fencing, reentrancy,
keep-alive and its lost signal, NOSCRIPT, and what ``async with`` raises."""

from __future__ import annotations

import asyncio

import pytest

from celery_redlock import AsyncRedlock, LockLost, LockNotAcquired
from celery_redlock.testing import ServerSet
from tests.waiting import wait_for

from .conftest import ROUND_SLACK, keys_on, run, take

pytestmark = pytest.mark.timeout(30)


def test_many_tasks_of_two_clients_never_overlap(masters: ServerSet) -> None:
    inside = 0
    most = 0
    holds = 0

    async def worker(rl: AsyncRedlock) -> None:
        nonlocal inside, most, holds
        for _ in range(4):
            async with rl.lock("shared", timeout=10):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.002)
                inside -= 1
                holds += 1

    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0) as one, AsyncRedlock(masters.urls, ttl=5.0) as two:
            await asyncio.gather(*(worker(one if k % 2 else two) for k in range(20)))

    run(main())
    assert most == 1
    assert holds == 80
    # A release returns once a quorum applied it; the other masters' replies are on their way.
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_acquire_release_and_refusal(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0, retry_count=0) as rl:
            lock, other = rl.lock("job"), rl.lock("job")
            assert await take(lock)
            assert lock.owned() and 4.5 < lock.validity <= 5.0
            assert not await other.acquire(blocking=False)
            assert other.last_error is not None and other.last_error.held_by_other
            assert await lock.extend(3.0) and lock.validity <= 3.0
            assert await lock.release()
            assert not lock.owned()
            # Release-then-acquire: another acquire started after release() returned is granted.
            assert await take(other)
            await other.release()

    run(main())
    # A release returns once a quorum applied it; the other masters' replies are on their way.
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_async_with_raises_lock_not_acquired_after_its_timeout(masters: ServerSet) -> None:
    async def main() -> float:
        async with AsyncRedlock(masters.urls, ttl=5.0, retry_delay=0.05) as rl, rl.lock("busy"):
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(LockNotAcquired):
                async with rl.lock("busy", timeout=0.3):
                    pass
            return loop.time() - started

    took = run(main())
    # Its timeout, then the attempt made at its deadline: one round, bounded by request_timeout
    # (the default 0.1 s), plus what a loaded host adds.
    assert 0.25 < took < 0.3 + 0.1 + ROUND_SLACK


def test_fences_grow_from_grant_to_grant(masters: ServerSet) -> None:
    async def main() -> list[int]:
        fences = []
        async with AsyncRedlock(masters.urls, ttl=5.0) as rl:
            for _ in range(3):
                lock = rl.lock("fenced", fenced=True)
                assert await take(lock)
                assert lock.fence is not None
                fences.append(lock.fence)
                await lock.release()
                assert lock.fence is None
        return fences

    fences = run(main())
    assert fences == sorted(set(fences))


def test_reentrant_by_the_same_task_only(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0, retry_count=0) as rl:
            lock = rl.lock("re", reentrant=True)
            async with lock:
                async with lock:
                    assert lock.depth == 2

                    async def other_task() -> bool:
                        return await rl.lock("re", reentrant=True).acquire(blocking=False)

                    assert not await asyncio.create_task(other_task())
                assert lock.depth == 1 and lock.owned()
            assert lock.depth == 0

    run(main())
    # A release returns once a quorum applied it; the other masters' replies are on their way.
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_keepalive_holds_past_the_ttl_and_signals_a_loss(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=0.5) as rl, rl.hold("kept") as held:
            await asyncio.sleep(1.2)  # over two TTLs: extended meanwhile
            held.ensure()
            assert not held.lost.is_set()
            for server in masters:  # the keys vanish under it (an operator, a flush)
                server.flushall()
            await asyncio.wait_for(held.lost.wait(), 2.0)
            with pytest.raises(LockLost):
                held.ensure()

    run(main())


def test_scripts_lost_by_every_master_are_sent_again(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0) as rl:
            lock = rl.lock("flushed", reentrant=True)
            assert await take(lock)  # links made: every script loaded
            for server in masters:
                client = server.client()
                client.script_flush()
                client.close()
            assert await lock.extend()  # EVALSHA -> NOSCRIPT -> EVAL, on each master
            assert await lock.release()
            # release() returns once a quorum answered; the others' EVAL is on its way (waited
            # for here, before aclose() closes the links it travels on).
            for _ in range(100):
                if keys_on(masters) == [[]] * 5:
                    break
                await asyncio.sleep(0.01)

    run(main())
    # A release returns once a quorum applied it; the other masters' replies are on their way.
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)
