"""Review 29: cancellation at every await point of an acquire, for each kind of async lock.

Invariants attacked:

- a cancelled acquire leaves nothing on the masters that refuses another client: once it is
  cancelled (and its holder, if any, released), another AsyncRedlock takes the lock at once,
  long before the TTL (30 s) could have freed it;
- a cancelled *fair* waiter leaves no queue entry that stalls the queue: the next waiter is
  granted at the holder's release, not when the stale entry expires (2 s);
- a cancelled call never ends up holding: whether the cancellation hit its acquire or the
  release that follows it at once (in the same task), owned() is False afterwards.

The cancellation point is chosen by counting event loop iterations (``sleep(0)``) after the
acquire's task starts: 0, 1, 2, ... walks every await of the call in turn (the round out, the
room joined, the sleep, the next round), deterministically.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from celery_redlock import AsyncRedlock
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import keys_on, run
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

KINDS: list[dict[str, Any]] = [{}, {"fenced": True}, {"fair": True}, {"reentrant": True}, {"keepalive": True}]
KIND_IDS = ["plain", "fenced", "fair", "reentrant", "keepalive"]


async def _take_and_drop(lock: Any, **args: Any) -> bool:
    """Acquire, then release at once if held: in one task, since a reentrant lock belongs to
    the task that took it (released from another task, it would be left held)."""
    if not await lock.acquire(**args):
        return False
    await lock.release()  # cancelled here too: its bytes are written, so it still releases
    return True


async def _cancel_after(task: asyncio.Task[bool], steps: int) -> bool | None:
    """Cancel ``task`` after ``steps`` loop iterations; True/False if it finished first, None
    if the cancellation ended it."""
    for _ in range(steps):
        if task.done():
            break
        await asyncio.sleep(0)
    task.cancel()
    try:
        return await asyncio.wait_for(task, 5.0)
    except asyncio.CancelledError:
        return None


def _lock_keys(masters: ServerSet, name: str) -> list[list[bytes]]:
    return [[k for k in keys if not k.endswith(b"~fence")] for keys in keys_on(masters, f"redlock:{name}*")]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_an_uncontended_acquire_cancelled_anywhere_leaves_nothing_that_refuses(
    masters: ServerSet, kind: dict[str, Any]
) -> None:
    name = f"review29:cancel-free-{'-'.join(kind) or 'plain'}"

    async def main() -> list[float]:
        waits = []
        async with AsyncRedlock(masters.urls, ttl=30.0) as one, AsyncRedlock(masters.urls, ttl=30.0) as two:
            for steps in range(0, 24):
                lock = one.lock(name, **kind)
                task = asyncio.create_task(_take_and_drop(lock, blocking=False))
                outcome = await _cancel_after(task, steps)
                assert not lock.owned(), (steps, outcome)
                other = two.lock(name, **kind)
                started = time.monotonic()
                assert await other.acquire(timeout=2.0), (steps, outcome, other.last_error)
                waits.append(time.monotonic() - started)
                await other.release()
        return waits

    waits = run(main())
    # The retraction is written before the cancellation goes on: the other client may meet
    # the key for a round or two (its bytes race the retraction's), never for seconds.
    assert max(waits) < 0.75, waits
    assert wait_for(lambda: _lock_keys(masters, name) == [[]] * 5, 5.0), _lock_keys(masters, name)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_waiter_cancelled_anywhere_neither_holds_nor_stalls_the_next(
    masters: ServerSet, kind: dict[str, Any]
) -> None:
    name = f"review29:cancel-wait-{'-'.join(kind) or 'plain'}"

    async def main() -> list[float]:
        waits = []
        async with (
            AsyncRedlock(masters.urls, ttl=30.0) as one,
            AsyncRedlock(masters.urls, ttl=30.0) as two,
            AsyncRedlock(masters.urls, ttl=30.0) as three,
        ):
            for steps in range(0, 40, 1):
                holder = one.lock(name, **kind)
                assert await holder.acquire(timeout=2.0), holder.last_error
                waiter = two.lock(name, **kind)
                task = asyncio.create_task(_take_and_drop(waiter, timeout=5.0))
                outcome = await _cancel_after(task, steps)
                assert outcome is None, (steps, outcome)  # held by `holder` all along
                assert not waiter.owned()
                # A third client queues behind (for a fair lock: behind the cancelled entry's
                # ticket, if the cancellation left one), then the holder releases.
                third = three.lock(name, **kind)
                granted: list[float] = []

                async def take(third: Any = third, granted: list[float] = granted) -> bool:
                    if not await third.acquire(timeout=3.0):
                        return False
                    granted.append(time.monotonic())
                    await third.release()
                    return True

                got = asyncio.create_task(take())
                await asyncio.sleep(0.02)  # the spacing IS the scenario: `third` waits
                await holder.release()
                started = time.monotonic()
                assert await asyncio.wait_for(got, 5.0), (steps, third.last_error)
                waits.append(granted[0] - started)
        return waits

    waits = run(main())
    # Woken by the release (one round or so), not by a poll (0.5 s) or an entry's expiry (2 s).
    assert max(waits) < 0.4, waits
    assert wait_for(lambda: _lock_keys(masters, name) == [[]] * 5, 5.0), _lock_keys(masters, name)
