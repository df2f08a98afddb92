"""A hypothesis state machine over interleaved asyncio tasks on real masters.

Two AsyncRedlocks (two processes' worth of clients) share one event loop; four locks on one
resource, two per client. Steps start acquires as tasks (non-blocking, or waiting up to a
timeout: woken by the release), let the loop run for a while so the tasks interleave, release a
held lock, cancel a pending acquire mid-round or mid-wait. The properties:

1. exclusion: at most one lock is ``owned()`` at any time, and while one is, a probe by another
   client cannot acquire the resource;
2. progress: once ``release()`` returned True and nobody else is after the resource, another
   client's acquire is granted at once; with waiters, one of them holds it within a bound;
3. nothing is left: after cancelling and releasing everything, no key remains on any master.

Budget: ``REDLOCK_ASYNC_MACHINE_EXAMPLES`` (default 8) examples of ``REDLOCK_ASYNC_MACHINE_STEPS``
(default 20) steps keep CI's share to a few seconds; raise them for a long run.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from celery_redlock import AsyncLock, AsyncRedlock
from celery_redlock.testing import ServerSet
from tests.waiting import wait_for

from .conftest import keys_on, take

EXAMPLES = int(os.environ.get("REDLOCK_ASYNC_MACHINE_EXAMPLES") or 8)
STEPS = int(os.environ.get("REDLOCK_ASYNC_MACHINE_STEPS") or 20)
RESOURCE = "machine"
LOCKS = 4
# How long a waiter may take to get a released lock: a notice comes at once; a lost one is
# covered by the fallback poll (wait_poll) and one more round.
WAKE_BOUND = 0.5 + 0.5


class AsyncMachine(RuleBasedStateMachine):
    masters: ServerSet

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clients = [AsyncRedlock(self.masters.urls, ttl=10.0, wait_poll=0.5) for _ in range(2)]
        self.locks: list[AsyncLock] = []
        for k in range(LOCKS):
            lock = self.clients[k % 2].lock(RESOURCE)
            assert isinstance(lock, AsyncLock)
            self.locks.append(lock)
        self.pending: dict[int, asyncio.Task[bool]] = {}

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _idle(self, k: int) -> bool:
        return k not in self.pending and not self.locks[k].owned()

    def _settle(self) -> None:
        """Forget finished acquire tasks (their result is the lock's owned())."""
        for k, task in list(self.pending.items()):
            if task.done():
                del self.pending[k]
                if not task.cancelled():
                    task.result()  # an exception here is a failure of the lock

    @initialize()
    def contend(self) -> None:
        """Every example starts with two clients after the resource: one of them holds it."""
        self._start(0, 2.0)
        self._start(1, 2.0)
        self.advance(30)

    @rule(k=st.integers(0, LOCKS - 1), wait=st.sampled_from([0.0, 0.05, 2.0]))
    def start_acquire(self, k: int, wait: float) -> None:
        self._start(k, wait)
        self.advance(1)  # under way: its round in flight, or its wait begun

    def _start(self, k: int, wait: float) -> None:
        if not self._idle(k):
            return
        lock = self.locks[k]
        coro = lock.acquire(blocking=False) if wait == 0 else lock.acquire(timeout=wait)
        self.pending[k] = self.loop.create_task(coro)

    @rule(ms=st.sampled_from([0, 1, 5, 30]))
    def advance(self, ms: int) -> None:
        self._run(asyncio.sleep(ms / 1000))
        self._settle()

    @rule(k=st.integers(0, LOCKS - 1))
    def cancel(self, k: int) -> None:
        task = self.pending.get(k)
        if task is None:
            return
        task.cancel()
        self._run(asyncio.gather(task, return_exceptions=True))
        self._settle()

    @rule(k=st.integers(0, LOCKS - 1))
    def release(self, k: int) -> None:
        self._settle()
        lock = self.locks[k]
        if not lock.owned():
            return
        assert self._run(lock.release())
        waiters = [j for j, task in self.pending.items() if not task.done()]
        if not waiters:
            # Progress: another client's acquire, started now, is granted at once: no master
            # refuses it (an attempt whose answers came late on a loaded host is made again).
            probe = self.clients[(k + 1) % 2].lock(RESOURCE)
            assert self._run(take(probe)), ("a released lock was refused", probe.last_error)
            assert self._run(probe.release())
            return
        deadline = time.monotonic() + WAKE_BOUND
        while time.monotonic() < deadline and not any(lock.owned() for lock in self.locks):
            if all(self.pending[j].done() for j in waiters):
                break  # they gave up (their timeouts) or were granted
            self._run(asyncio.sleep(0.005))
        self._settle()
        gave_up = all(j not in self.pending for j in waiters)
        assert gave_up or any(lock.owned() for lock in self.locks), "no waiter got the released lock"

    @invariant()
    def exclusion(self) -> None:
        held = [k for k, lock in enumerate(self.locks) if lock.owned()]
        assert len(held) <= 1, f"locks {held} are all owned"
        if held:
            probe = self.clients[(held[0] + 1) % 2].lock(RESOURCE)
            assert not self._run(probe.acquire(blocking=False)), (
                f"lock {held[0]} is owned, yet a probe got it"
            )

    def teardown(self) -> None:
        try:
            for task in self.pending.values():
                task.cancel()
            if self.pending:
                self._run(asyncio.gather(*self.pending.values(), return_exceptions=True))
            for lock in self.locks:
                self._run(lock.release())
            for client in self.clients:
                self._run(client.aclose())
        finally:
            self.loop.close()
        # A release returns once a quorum applied it; the other masters' replies are on their way.
        masters = self.masters
        left = keys_on(masters)
        assert wait_for(lambda: keys_on(masters) == [[]] * 5, 5.0), ("a key was left behind", left)


@pytest.mark.timeout(120)
def test_async_machine(masters: ServerSet) -> None:
    AsyncMachine.masters = masters
    run_state_machine_as_test(
        AsyncMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )
