"""The asyncio lock's tests: five real embedded masters, loopback only, started once per session
and brought back (resumed, restarted, emptied) before each test.

Coroutines are run with ``asyncio.run`` inside plain tests (:func:`run`): no pytest plugin is
needed, every test gets a loop of its own that ends with it, and ``asyncio.run`` itself fails
the test if a task of ours is left behind (see ``test_aclose_leaves_no_task``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from celery_redlock.testing import ServerSet

T = TypeVar("T")

# What a loaded 2-core host (a CPU hog on one core) may add to one round past its
# request_timeout, or to one wake-up past its time: the loop and the masters' processes each
# waiting a time slice or a few for a core. Tens of milliseconds are seen (66 ms beside a CI
# run); a timing bound here is the configured time plus this, not a number of its own.
ROUND_SLACK = 0.2

# The waiting tests' settings: wait_poll and retry_delay far above what they measure, so only a
# notice (or the expiry the refusals reported) can explain a quick wake-up.
SLOW = {"wait_poll": 5.0, "retry_delay": 2.0}
# A waiter that no notice woke tries again on its fallback poll: a jittered wait_poll, at least
# half of it, after its sleep began (before the release). Woken within half of that, it was the
# notice that woke it: a publish and one round, milliseconds, tens of them on a loaded host.
WOKEN_BY_NOTICE = 0.5 * 0.5 * SLOW["wait_poll"]


@pytest.fixture(scope="session")
def server_set() -> Iterator[ServerSet]:
    with ServerSet(5) as servers:
        yield servers


@pytest.fixture
def masters(server_set: ServerSet) -> ServerSet:
    server_set.ensure_running()
    return server_set


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def keys_on(masters: ServerSet, pattern: str = "redlock:*") -> list[list[bytes]]:
    """Every key matching ``pattern`` on each running master."""
    found = []
    for server in masters:
        if server.running and not server.paused:
            client = server.client()
            try:
                found.append(sorted(client.keys(pattern)))
            finally:
                client.close()
    return found


async def take(lock: Any, within: float = 5.0) -> bool:
    """``await lock.acquire(blocking=False)`` for a test whose subject is not the single attempt:
    an attempt that failed only because answers came late (a loaded host) is made again, until
    ``within``. A refusal by a holder is final at once: held on so many masters that no quorum is
    free, so a test that means "the key is free now" still fails when it is not. A held vote or
    two besides late answers are masters still working off a release that a quorum confirmed."""
    deadline = time.monotonic() + within
    while True:
        if await lock.acquire(blocking=False):
            return True
        error = lock.last_error
        # Held: enough masters answered that the key is taken that no quorum is left free. Fewer
        # held votes than that are masters still working off a release that a quorum confirmed
        # (its other deletes are not waited for); the attempt failed on the late answers.
        held = error is None or sum(v.kind == "held" for v in error.votes) > len(error.votes) - error.quorum
        if held or time.monotonic() >= deadline:
            return False
