"""Review 29: an AsyncRedlock's life: aclose() with rounds in flight, a second event loop, use
after aclose(), and bad arguments. Real embedded masters on loopback; every wait has a deadline.

Invariants attacked:

- aclose() ends every task and every call of the AsyncRedlock: an acquire whose round is out to
  a paused master when aclose() runs ends by its own bound (request_timeout), never hangs.
- an AsyncRedlock serves the event loop it first ran in: used from another loop it says so (a
  ConfigError naming the thing), never hangs nor fails silently as timeouts.
- a closed AsyncRedlock refuses with a ConfigError; bad arguments fail where they were written.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest

from celery_redlock import AsyncRedlock
from celery_redlock.errors import ConfigError
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import keys_on, run, take
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(40)


def test_aclose_ends_an_acquire_whose_round_waits_on_a_paused_master(masters: ServerSet) -> None:
    """A round out to a paused master when aclose() runs: the acquire must end by its bound
    (request_timeout), not wait for a reply the closed transport will never read."""

    async def main() -> tuple[float, object]:
        rl = AsyncRedlock(masters.urls, ttl=5.0, request_timeout=1.0)
        lock = rl.lock("review29:aclose-inflight")
        assert await lock.acquire(blocking=False)  # every link made
        await lock.release()
        masters[0].pause()
        try:
            task = asyncio.create_task(rl.lock("review29:aclose-inflight2").acquire(blocking=False))
            await asyncio.sleep(0.1)  # the spacing IS the scenario: the round is out
            assert not task.done()
            started = time.monotonic()
            await rl.aclose()
            done, _ = await asyncio.wait([task], timeout=3.0)
            took = time.monotonic() - started
            outcome: object = "pending"
            if done:
                outcome = task.exception() or task.result()
            else:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            return took, outcome
        finally:
            masters[0].resume()

    took, outcome = run(main())
    assert outcome != "pending", "the acquire still waited 3 s after aclose() (request_timeout 1 s)"
    assert took < 1.0 + 0.5, took
    # Whatever it answered, no key may be left behind by it.
    assert wait_for(lambda: all(k == [] for k in keys_on(masters)), 5.0), keys_on(masters)


def test_an_asyncredlock_used_from_a_second_event_loop_says_so(masters: ServerSet) -> None:
    """The documented limit ("serves the event loop it first ran in") must be a clear error,
    not a hang: its links and its deadline timer belong to the first, closed, loop."""
    rl = AsyncRedlock(masters.urls, ttl=5.0, request_timeout=0.3, retry_count=0)

    async def first() -> None:
        lock = rl.lock("review29:loops")
        assert await take(lock)
        await lock.release()

    async def second() -> object:
        try:
            return await asyncio.wait_for(rl.lock("review29:loops").acquire(blocking=False), 3.0)
        except asyncio.TimeoutError:
            return "hang"
        except ConfigError as exc:
            return exc

    run(first())
    outcome = run(second())
    assert isinstance(outcome, ConfigError), outcome
    assert "event loop" in str(outcome)

    # A fresh AsyncRedlock in this loop works, and nothing was left on the masters.
    async def fresh() -> bool:
        async with AsyncRedlock(masters.urls, ttl=5.0) as other:
            lock = other.lock("review29:loops")
            ok = await lock.acquire(blocking=False)
            await lock.release()
            return ok

    assert run(fresh())


def test_a_waiter_of_a_second_event_loop_says_so(masters: ServerSet) -> None:
    """As above, for a waiter (the listening links of the first loop)."""
    rl = AsyncRedlock(masters.urls, ttl=5.0, request_timeout=0.3, retry_count=0)

    async def first() -> None:
        held = rl.lock("review29:loops-wait")
        assert await take(held)
        assert not await rl.lock("review29:loops-wait").acquire(timeout=0.3)
        await held.release()

    async def second() -> object:
        try:
            return await asyncio.wait_for(rl.lock("review29:loops-wait2").acquire(timeout=0.5), 3.0)
        except asyncio.TimeoutError:
            return "hang"
        except ConfigError as exc:
            return exc

    run(first())
    outcome = run(second())
    assert isinstance(outcome, ConfigError), outcome


def test_a_closed_asyncredlock_refuses_every_operation(masters: ServerSet) -> None:
    async def main() -> None:
        rl = AsyncRedlock(masters.urls, ttl=5.0)
        held = rl.lock("review29:closed")
        assert await take(held)
        await rl.aclose()
        for call in (
            lambda: rl.lock("review29:closed2").acquire(blocking=False),
            lambda: rl.lock("review29:closed2", fair=True).acquire(timeout=0.2),
            lambda: rl.lock("review29:closed2", reentrant=True).acquire(blocking=False),
            lambda: rl.lock("review29:closed2", fenced=True).acquire(blocking=False),
            lambda: rl.holder("review29:closed"),
            lambda: held.extend(),
        ):
            with pytest.raises(ConfigError, match="closed"):
                await asyncio.wait_for(call(), 2.0)
        await rl.aclose()  # twice: nothing more to do, no error

    run(main())


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda rl: rl.lock("n", math.nan), "ttl"),
        (lambda rl: rl.lock("n", math.inf), "ttl"),
        (lambda rl: rl.lock("n", -1.0), "ttl"),
        (lambda rl: rl.lock("n", 1e300), "ttl"),
        (lambda rl: rl.lock("n", "10"), "ttl"),
        (lambda rl: rl.lock("n", timeout=math.nan), "timeout"),
        (lambda rl: rl.lock("n", timeout=-2), "timeout"),
        (lambda rl: rl.lock("n", timeout="1"), "timeout"),
        (lambda rl: rl.lock("n", blocking="no"), "blocking"),
        (lambda rl: rl.lock("n", keepalive="yes"), "keepalive"),
        (lambda rl: rl.lock("n", fair="False"), "fair"),
        (lambda rl: rl.lock("n", reentrant=1), "reentrant"),
        (lambda rl: rl.lock("n", fenced="true"), "fenced"),
        (lambda rl: rl.lock("n", holder=3), "holder"),
        (lambda rl: rl.lock(""), "name"),
        (lambda rl: rl.lock(b"n"), "name"),
        (lambda rl: rl.lock("n", fair=True, reentrant=True), "fair"),
        (lambda rl: rl.hold("n", 0.05), "ttl"),
    ],
)
def test_bad_lock_arguments_fail_where_written(
    masters: ServerSet, make: Callable[[AsyncRedlock], object], what: str
) -> None:
    rl = AsyncRedlock(masters.urls, ttl=5.0)
    with pytest.raises(ConfigError, match=what):
        make(rl)


def test_bad_acquire_and_extend_arguments_fail_before_any_round(masters: ServerSet) -> None:
    async def main() -> None:
        async with AsyncRedlock(masters.urls, ttl=5.0) as rl:
            for kind in ({}, {"fair": True}, {"reentrant": True}, {"fenced": True}):
                lock = rl.lock("review29:args", **kind)  # type: ignore[arg-type]
                for args, what in (
                    ({"timeout": math.nan}, "timeout"),
                    ({"timeout": -3}, "timeout"),
                    ({"timeout": "2"}, "timeout"),
                    ({"blocking": "false"}, "blocking"),
                    ({"blocking": False, "timeout": 1.0}, "timeout"),
                ):
                    with pytest.raises(ConfigError, match=what):
                        await asyncio.wait_for(lock.acquire(**args), 2.0)
                assert await take(lock)
                for ttl in (math.nan, math.inf, -1.0, "5", 1e300):
                    with pytest.raises(ConfigError, match="ttl"):
                        await lock.extend(ttl)  # type: ignore[arg-type]
                assert lock.owned()
                await lock.release()
            assert keys_on(masters, "redlock:review29:args") == [[]] * 5 or wait_for(
                lambda: keys_on(masters, "redlock:review29:args") == [[]] * 5, 5.0
            )

    run(main())
