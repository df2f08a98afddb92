"""Review 29: fair order across asyncio and threads, with a waiter that gives up mid-queue.

Invariant (arrival order): waiters whose joins were acknowledged one after the other take the
lock in that order, whichever transport they use (an ``AsyncRedlock`` task, a threaded
``Redlock`` in a thread); a waiter that is cancelled while queued costs the ones behind it
nothing (the next is woken by the release before it, not when the stale entry expires).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from celery_redlock import AsyncRedlock, Redlock
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import run, take

pytestmark = pytest.mark.timeout(60)

NAME = "review29:fair-mixed"
SPACING = 0.15  # the spacing IS the scenario: each waiter's join is acknowledged before the next


def test_fair_order_across_async_and_threads_with_a_cancelled_waiter(masters: ServerSet) -> None:
    order: list[tuple[str, float]] = []
    mutex = threading.Lock()
    thread_joined = threading.Event()
    thread_go = threading.Event()

    def threaded() -> None:
        rl = Redlock(masters.urls, ttl=20.0, wait_poll=3.0)
        try:
            lock = rl.lock(NAME, fair=True)
            thread_go.wait(10.0)
            thread_joined.set()
            if lock.acquire(timeout=10.0):
                with mutex:
                    order.append(("thread", time.monotonic()))
                time.sleep(0.02)
                lock.release()
        finally:
            rl.close()

    thread = threading.Thread(target=threaded, daemon=True)
    thread.start()

    async def main() -> float:
        async with (
            AsyncRedlock(masters.urls, ttl=20.0, wait_poll=3.0) as one,
            AsyncRedlock(masters.urls, ttl=20.0, wait_poll=3.0) as two,
        ):
            holder = one.lock(NAME, fair=True)
            assert await take(holder)

            async def wait(tag: str, rl: AsyncRedlock) -> None:
                lock = rl.lock(NAME, fair=True)
                if await lock.acquire(timeout=10.0):
                    with mutex:
                        order.append((tag, time.monotonic()))
                    await asyncio.sleep(0.02)
                    await lock.release()

            first = asyncio.create_task(wait("first", two))
            await asyncio.sleep(SPACING)
            quitter = asyncio.create_task(wait("quitter", one))
            await asyncio.sleep(SPACING)
            thread_go.set()
            await asyncio.get_running_loop().run_in_executor(None, thread_joined.wait, 10.0)
            await asyncio.sleep(SPACING)
            last = asyncio.create_task(wait("last", two))
            await asyncio.sleep(SPACING)
            quitter.cancel()  # gives up while queued between `first` and the thread
            await asyncio.gather(quitter, return_exceptions=True)
            released = time.monotonic()
            await holder.release()
            await asyncio.wait_for(asyncio.gather(first, last), 15.0)
            return released

    released = run(main())
    thread.join(15.0)
    assert not thread.is_alive()
    assert [tag for tag, _ in order] == ["first", "thread", "last"], order
    # Each woken by the release before it (one round, plus the 20 ms hold), never by a poll
    # (3 s) nor by the quitter's entry expiring (entry_ttl >= 2 s).
    assert order[-1][1] - released < 1.0, [t - released for _, t in order]
