"""AsyncRedlock on uvloop's event loop: the central scenarios again, on real masters.

uvloop is the loop a uvicorn or gunicorn worker runs when it is installed, and its transports
are not asyncio's (libuv's sockets, its own call scheduling, its own ``create_connection``): the
links' protocol callbacks, the deadlines' timer, cancellation mid-round and the tasks ``aclose``
ends are each run here on it. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from celery_redlock import AsyncRedlock, LockLost
from celery_redlock.testing import ServerSet
from tests.waiting import wait_for

from .conftest import SLOW, WOKEN_BY_NOTICE, keys_on, take

uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (pip install 'celery-redlock[test]')")

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")


def run_on_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a new uvloop loop, which is checked to be the one running."""

    async def checked() -> T:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        return await coro

    return uvloop.run(checked())  # type: ignore[no-any-return]


def test_many_tasks_of_two_clients_never_overlap(masters: ServerSet) -> None:
    inside = 0
    most = 0
    holds = 0

    async def worker(rl: AsyncRedlock) -> None:
        nonlocal inside, most, holds
        for _ in range(4):
            async with rl.lock("uv-shared", timeout=10):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.002)
                inside -= 1
                holds += 1

    async def main() -> None:
        # Room for the first burst of connects (each of the 20 tasks' first round makes its own,
        # a full handshake each) on a loaded 2-core machine: exclusion is the subject here.
        async with (
            AsyncRedlock(masters.urls, ttl=5.0, request_timeout=0.5) as one,
            AsyncRedlock(masters.urls, ttl=5.0, request_timeout=0.5) as two,
        ):
            await asyncio.wait_for(asyncio.gather(*(worker(one if k % 2 else two) for k in range(20))), 20)

    run_on_uvloop(main())
    assert most == 1
    assert holds == 80
    # A release returns once a quorum applied it; the other masters' replies are on their way.
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_a_waiter_is_woken_by_the_release(masters: ServerSet) -> None:
    async def main() -> float:
        async with (
            AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as holder_rl,
            AsyncRedlock(masters.urls, ttl=10.0, **SLOW) as waiter_rl,
        ):
            held = holder_rl.lock("uv-woken")
            assert await take(held)
            waiter = waiter_rl.lock("uv-woken")
            waiting = asyncio.create_task(waiter.acquire(timeout=8))
            # It joined the room on every master, tried again, and sleeps.
            for _ in range(300):
                if waiter_rl.subscriber.listening() == 5:
                    break
                await asyncio.sleep(0.01)
            assert waiter_rl.subscriber.listening() == 5
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert await held.release()
            released = time.monotonic()
            assert await asyncio.wait_for(waiting, 8)
            took = time.monotonic() - released
            await waiter.release()
            return took

    took = run_on_uvloop(main())
    assert took < WOKEN_BY_NOTICE, took  # a poll would come seconds after the release
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_a_cancelled_acquire_leaves_no_key(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=30.0, request_timeout=2.0) as rl:
            warm = rl.lock("uv-warm")
            assert await take(warm)  # links made, then idle
            await warm.release()
            for server in masters:
                server.pause()  # the SET is written, and answered only after the cancellation
            try:
                task = asyncio.create_task(rl.lock("uv-cancelled").acquire(blocking=False))
                await asyncio.sleep(0.2)
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 5)
            finally:
                for server in masters:
                    server.resume()
            # The SETs run, then the retraction written behind them on the same links: waited
            # for here, before aclose() closes the links it travels on.
            for _ in range(300):
                if keys_on(masters) == [[]] * 5:
                    break
                await asyncio.sleep(0.01)

    run_on_uvloop(main())
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_keepalive_extends_and_signals_a_loss_on_a_majority(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=0.5) as rl, rl.hold("uv-kept") as held:
            await asyncio.sleep(1.2)  # over two TTLs: extended meanwhile
            held.ensure()
            assert not held.lost.is_set()
            for server in list(masters)[:3]:  # gone from a majority (an operator, a flush)
                client = server.client()
                try:
                    client.delete("redlock:uv-kept")
                finally:
                    client.close()
            await asyncio.wait_for(held.lost.wait(), 3.0)
            with pytest.raises(LockLost):
                held.ensure()

    run_on_uvloop(main())
    assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), keys_on(masters)


def test_aclose_leaves_no_task(masters: ServerSet) -> None:
    async def main() -> set[asyncio.Task[Any]]:
        rl = AsyncRedlock(masters.urls, ttl=2.0, request_timeout=0.1, **SLOW)
        held = rl.hold("uv-closed")
        assert await take(held)
        # A waiter's listening links, then a lost link's connects and a kept release's delivery.
        waiting = asyncio.create_task(rl.lock("uv-closed").acquire(timeout=8))
        for _ in range(300):
            if rl.subscriber.listening() == 5:
                break
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 5)
        masters[0].kill()
        await held.release()
        await asyncio.sleep(0.15)
        await asyncio.wait_for(rl.aclose(), 5)
        assert rl.subscriber.listening() == 0
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert run_on_uvloop(main()) == set()
