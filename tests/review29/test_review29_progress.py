"""Review 29: progress and ownership of the asyncio locks, on real masters.

Invariants attacked:

- a threaded ``Redlock`` holder's release wakes an ``AsyncRedlock`` waiter on the same name at
  once (and the reverse), not at its next poll;
- a keep-alive stops with release() and with aclose(): a released lock is never extended again
  (its task is gone), and after aclose() an unreleased lock expires with its TTL;
- a reentrant lock is re-entered by its own task only: tasks made inside the block
  (``create_task``, ``gather``) contend like strangers, and its release from a child task frees
  nothing of the parent's;
- aclose() while tasks wait for a held lock: every waiter ends, by its own bound, with no error
  other than "closed", and no task is left.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from celery_redlock import AsyncRedlock, Redlock
from celery_redlock.errors import ConfigError
from celery_redlock.lock.aio import AsyncReentrantLock
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import keys_on, run, take
from tests.core.conftest import take as take_threaded
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

# A long poll, so a waiter woken by its poll is told apart from one woken by the release.
POLL = 3.0
# A waiter that no notice woke tries again on its fallback poll: a jittered POLL, at least half
# of it, after its sleep began (before the release). Woken within half of that, the notice woke
# it: a publish and one round, milliseconds, tenths of a second on a loaded host.
WOKEN_BY_NOTICE = 0.5 * 0.5 * POLL


def test_a_threaded_holders_release_wakes_an_async_waiter_at_once(masters: ServerSet) -> None:
    taken = threading.Event()
    go = threading.Event()
    released_at: list[float] = []

    def hold() -> None:
        rl = Redlock(masters.urls, ttl=20.0)
        try:
            lock = rl.lock("review29:mixed")
            assert take_threaded(lock)
            taken.set()
            go.wait(10.0)
            released_at.append(time.monotonic())
            assert lock.release()
        finally:
            rl.close()

    async def main() -> float:
        async with AsyncRedlock(masters.urls, ttl=20.0, wait_poll=POLL) as arl:
            lock = arl.lock("review29:mixed")
            task = asyncio.create_task(lock.acquire(timeout=8.0))
            await asyncio.sleep(0.3)  # the spacing IS the scenario: the waiter sleeps in its room
            assert not task.done()
            go.set()
            assert await asyncio.wait_for(task, 10.0), lock.last_error
            woke = time.monotonic()
            await lock.release()
            return woke

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(10.0)
    woke = run(main())
    thread.join(10.0)
    assert not thread.is_alive()
    assert woke - released_at[0] < WOKEN_BY_NOTICE, woke - released_at[0]


def test_an_async_holders_release_wakes_a_threaded_waiter_at_once(masters: ServerSet) -> None:
    result: list[float] = []
    started = threading.Event()

    def wait() -> None:
        rl = Redlock(masters.urls, ttl=20.0, wait_poll=POLL)
        try:
            lock = rl.lock("review29:mixed2")
            started.set()
            if lock.acquire(timeout=8.0):
                result.append(time.monotonic())
                lock.release()
        finally:
            rl.close()

    async def main() -> float:
        async with AsyncRedlock(masters.urls, ttl=20.0) as arl:
            lock = arl.lock("review29:mixed2")
            assert await take(lock)
            thread.start()
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 10.0)
            await asyncio.sleep(0.3)  # the spacing IS the scenario: the thread sleeps in its room
            released = time.monotonic()
            await lock.release()
            return released

    thread = threading.Thread(target=wait, daemon=True)
    released = run(main())
    thread.join(10.0)
    assert not thread.is_alive() and result
    assert result[0] - released < WOKEN_BY_NOTICE, result[0] - released


def test_a_keepalive_stops_with_release_and_with_aclose(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0) as rl:
            held = rl.hold("review29:keep", 0.6)
            assert await take(held)
            await asyncio.sleep(0.9)  # kept past its TTL
            assert held.owned()
            assert len(rl.keepalives) == 1
            await held.release()
            await asyncio.sleep(0)  # the cancelled task's last step
            assert not rl.keepalives
            # Taken again by another lock at once; the first's keep-alive never touches it.
            other = rl.lock("review29:keep", 0.6)
            assert await other.acquire(timeout=1.0)
            await asyncio.sleep(1.0)
            assert not other.owned()
        rl2 = AsyncRedlock(masters.urls, ttl=5.0)
        kept = rl2.hold("review29:keep2", 0.6)
        assert await take(kept)
        await rl2.aclose()  # not released: it must expire with its TTL, never be extended again
        assert not rl2.keepalives

    run(main())
    # The masters expire both keys (TTL 0.6 s; a keep-alive left running would extend the
    # second every 0.2 s for ever).
    assert wait_for(lambda: keys_on(masters, "redlock:review29:keep*") == [[]] * 5, 3.0), keys_on(
        masters, "redlock:review29:keep*"
    )


def test_tasks_made_inside_a_reentrant_block_contend_like_strangers(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0, retry_count=0) as rl:
            lock = rl.lock("review29:re", reentrant=True)
            assert isinstance(lock, AsyncReentrantLock)
            async with lock:

                async def child() -> tuple[bool, bool, int]:
                    got = await lock.acquire(blocking=False)
                    # Its release must not free the parent's holding.
                    freed = await lock.release()
                    return got, freed, lock.depth

                results = await asyncio.gather(child(), child(), asyncio.create_task(child()))
                assert [r[0] for r in results] == [False, False, False], results
                assert [r[2] for r in results] == [0, 0, 0]
                assert lock.depth == 1 and lock.owned()
                # Still held against every other task (a new lock object of this task would
                # re-enter: the holdings are per (key, task), as the threaded lock's per thread).
                stranger = rl.lock("review29:re", reentrant=True)
                assert not await asyncio.create_task(stranger.acquire(blocking=False))
                # And re-entered by this task.
                async with lock:
                    assert lock.depth == 2
            assert lock.depth == 0 and not lock.owned()
            assert await take(rl.lock("review29:re", reentrant=True))

    run(main())


def test_aclose_while_tasks_wait_ends_every_one_of_them(masters: ServerSet) -> None:
    async def main() -> list[object]:
        other = AsyncRedlock(masters.urls, ttl=10.0)
        rl = AsyncRedlock(masters.urls, ttl=10.0, wait_poll=1.0, retry_delay=1.0)
        try:
            held = other.lock("review29:closing")
            held_fair = other.lock("review29:closing-fair", fair=True)
            held_re = other.lock("review29:closing-re", reentrant=True)
            assert await take(held)
            assert await take(held_re)
            assert await take(held_fair)
            waiters = [
                asyncio.create_task(rl.lock("review29:closing").acquire(timeout=4.0)),
                asyncio.create_task(rl.lock("review29:closing").acquire()),  # retry_count tries
                asyncio.create_task(rl.lock("review29:closing-re", reentrant=True).acquire(timeout=4.0)),
                asyncio.create_task(rl.lock("review29:closing-fair", fair=True).acquire(timeout=4.0)),
                asyncio.create_task(rl.lock("review29:closing", fenced=True).acquire(timeout=4.0)),
            ]
            await asyncio.sleep(0.3)  # the spacing IS the scenario: they wait
            assert not any(w.done() for w in waiters)
            started = time.monotonic()
            await rl.aclose()
            _, pending = await asyncio.wait(waiters, timeout=3.0)
            took = time.monotonic() - started
            for task in pending:
                task.cancel()
            assert not pending, f"{len(pending)} waiters still pending 3 s after aclose()"
            # By their own poll or retry delay (1 s) at most, not their timeout (4 s).
            assert took < 1.0 + 0.5, took
            return [w.exception() or w.result() for w in waiters]
        finally:
            await other.aclose()

    outcomes = run(main())
    for outcome in outcomes:
        assert outcome is False or (isinstance(outcome, ConfigError) and "closed" in str(outcome)), outcome


@pytest.mark.parametrize("fault", ["paused", "killed"])
def test_a_waiter_is_woken_by_the_release_with_a_faulty_minority(masters: ServerSet, fault: str) -> None:
    """A paused (SIGSTOP) or dead master costs a round at most request_timeout; the waiter is
    still woken by the release of the other four, not by its (long) poll."""

    async def main() -> tuple[float, float]:
        async with (
            AsyncRedlock(masters.urls, ttl=20.0, request_timeout=0.2) as one,
            AsyncRedlock(masters.urls, ttl=20.0, request_timeout=0.2, wait_poll=POLL) as two,
        ):
            # Links made before the fault, as in a running service.
            for rl in (one, two):
                warm = rl.lock("review29:faulty-warm")
                assert await take(warm)
                await warm.release()
            if fault == "paused":
                masters[0].pause()
            else:
                masters[0].kill()
            try:
                held = one.lock("review29:faulty")
                started = time.monotonic()
                assert await held.acquire(blocking=False), held.last_error
                first_round = time.monotonic() - started
                waiter = two.lock("review29:faulty")
                task = asyncio.create_task(waiter.acquire(timeout=8.0))
                await asyncio.sleep(0.8)  # the spacing IS the scenario: it sleeps in its room
                assert not task.done()
                released = time.monotonic()
                assert await held.release()
                assert await asyncio.wait_for(task, 10.0), waiter.last_error
                woke = time.monotonic() - released
                await waiter.release()
                return first_round, woke
            finally:
                if fault == "paused":
                    masters[0].resume()

    first_round, woke = run(main())
    assert first_round < 0.2 + 0.15, first_round
    # Its next attempt waits out the faulty master (0.2 s at most); a poll would be 1.5 s or more.
    assert woke < 0.2 + WOKEN_BY_NOTICE, woke
