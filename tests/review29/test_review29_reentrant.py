"""Review 29: a re-entry of an asyncio reentrant lock cut short by a timeout of its own task.

Invariant: ``owned()`` True implies no other client can acquire. A re-entry is one R_ENTER
round, which sets the key's TTL to the lock's ``ttl`` on every master it reaches. Cut short
(a cancellation the task catches, as ``asyncio.timeout`` around the inner ``async with``: the
task goes on holding the outer one),
any master may have applied it, so the holder's validity must be settled as a failed extension
to that TTL (as a cancelled ``extend()`` is), never left at what an earlier, longer
``extend()`` gave.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from celery_redlock import AsyncRedlock
from celery_redlock.lock.aio import AsyncReentrantLock
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import run, take

pytestmark = pytest.mark.timeout(30)


def test_a_reentry_cut_short_leaves_no_validity_the_masters_do_not_keep(masters: ServerSet) -> None:
    async def main() -> tuple[bool, bool, float]:
        async with AsyncRedlock(masters.urls, ttl=1.0) as rl, AsyncRedlock(masters.urls, ttl=1.0) as other:
            lock = rl.lock("review29:reentry", reentrant=True)
            assert isinstance(lock, AsyncReentrantLock)
            assert await take(lock)
            assert await lock.extend(10.0)  # held for 10 s now, on the masters and here
            # Cut short in its own task once the R_ENTER round is written (what
            # asyncio.timeout() around an inner ``async with`` does), the task goes on holding.
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().call_soon(task.cancel)
            with pytest.raises(asyncio.CancelledError):
                await lock.acquire(blocking=False)
            if sys.version_info >= (3, 11):
                task.uncancel()
            assert lock.depth == 1
            # The masters may now expire the key 1 s from the re-entry (R_ENTER's PEXPIRE).
            seen: list[tuple[bool, float]] = []
            held = lock.holding()  # this task's holding (owned() asks the calling task's)
            assert held is not None

            async def stranger() -> bool:  # a task of its own: another owner
                taking = other.lock("review29:reentry", reentrant=True)
                if not await taking.acquire(timeout=3.0):
                    return False
                seen.append((held.owned(), held.validity))  # the first holder's view, now
                await taking.release()
                return True

            got = await asyncio.create_task(stranger())
            await lock.release()
            both, left = seen[0] if seen else (False, 0.0)
            return got, both, left

    got, both, left = run(main())
    assert got
    assert not both, f"another client acquired while the holder's owned() was True ({left:.2f} s left)"
