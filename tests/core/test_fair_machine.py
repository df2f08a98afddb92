"""A hypothesis state machine that attacks fair order on real masters.

The properties (issue 16, part 3; design docs/design/waiting.md 3.4):

1. exclusion: at most one waiter holds the resource at any time;
2. arrival order: each grant goes to the earliest arrival still waiting. Arrival here means the
   waiter's entry is on every running master before the next waiter starts, so the masters
   agree on the order; with one master emptied (FLUSHALL, a restart without data) or paused for
   a while, a quorum still holds every entry, so the order must survive that too;
3. liveness: after a release, the next waiter is granted within a bound (entry TTL + a fallback
   poll when a master was disturbed, far less otherwise), and a waiter that gives up leaves no
   entry that holds the queue up;
4. nothing is left: once every waiter is granted and released, or gone, no key remains.

Steps: waiters arrive (threads on two Redlocks: one's waiters are woken by the release naming
them, through one subscriber that serves several members; the other's poll every few ms, so the
queue on the masters must keep them in order by itself), the holder releases, a waiter gives
up, one master is emptied or paused and resumed. Checked to fail when the script lets any waiter
take a free lock (a mutation run by hand: the polling half then barges).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

from .conftest import wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.explore]

WAIT_POLL = 0.5
ENTRY_TTL = 2.0  # max(2 s, 4 * WAIT_POLL): see fair.py
_names = itertools.count()


@dataclass
class Waiter:
    index: int
    cancel: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    granted_at: float | None = None
    gave_up: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class FairMachine(RuleBasedStateMachine):
    servers: ServerSet  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.servers.ensure_running()
        self.name = f"fair-machine-{os.getpid()}-{next(_names)}"
        # Half the waiters are woken by the release naming them; the other half poll every few
        # ms, so only the masters' queue (never the wake-up) can keep them in order.
        self.redlocks = [
            Redlock(self.servers.urls, wait_poll=WAIT_POLL, request_timeout=0.2),
            Redlock(
                self.servers.urls, wait="poll", retry_delay=0.02, wait_poll=WAIT_POLL, request_timeout=0.2
            ),
        ]
        self.waiters: list[Waiter] = []
        self.grants: list[int] = []
        self.inside = 0
        self.overlaps = 0
        self.mutex = threading.Lock()
        self.disturbed = False  # a master was emptied or paused: liveness may take an entry TTL
        self.emptied: set[int] = set()

    # -- helpers -------------------------------------------------------------------------------
    def _run(self, waiter: Waiter) -> None:
        lock = self.redlocks[waiter.index % 2].lock(self.name, ttl=30, fair=True)
        try:
            if not lock.acquire(timeout=120, cancelled=waiter.cancel.is_set):
                waiter.gave_up = True
                return
            with self.mutex:
                self.inside += 1
                self.overlaps += self.inside > 1
                self.grants.append(waiter.index)
                waiter.granted_at = time.monotonic()
            waiter.release.wait(120)
            with self.mutex:
                self.inside -= 1
            lock.release()
        finally:
            waiter.done.set()

    def _entries(self) -> list[set[bytes]]:
        """The queued members on every running master."""
        found = []
        for server in self.servers:
            if server.running and not server.paused:
                client = server.client()
                try:
                    found.append(set(client.zrange(f"redlock:{self.name}~queue", 0, -1)))
                finally:
                    client.close()
        return found

    def _holder(self) -> Waiter | None:
        held = [w for w in self.waiters if w.granted_at is not None and not w.done.is_set()]
        return held[0] if held else None

    def _waiting(self) -> list[Waiter]:
        return [
            w for w in self.waiters if w.granted_at is None and not w.cancel.is_set() and not w.done.is_set()
        ]

    # -- steps ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.waiters) < 8)
    @rule()
    def arrive(self) -> None:
        waiter = Waiter(len(self.waiters))
        known = set().union(*self._entries())
        self.waiters.append(waiter)
        waiter.thread = threading.Thread(target=self._run, args=(waiter,), daemon=True)
        waiter.thread.start()

        def arrived() -> bool:
            # Granted (the lock was free and nobody queued), or a new member on every master.
            if waiter.granted_at is not None:
                return True
            entries = self._entries()
            return (
                bool(entries)
                and all(found - known for found in entries)
                and len(set(map(frozenset, entries))) == 1
            )

        assert wait_for(arrived, 10), f"waiter {waiter.index} never queued everywhere: {self._entries()}"

    @precondition(lambda self: self._holder() is not None)
    @rule()
    def release(self) -> None:
        holder = self._holder()
        assert holder is not None
        waiting = self._waiting()
        released = time.monotonic()
        holder.release.set()
        assert holder.done.wait(10)
        if waiting:
            bound = ENTRY_TTL + 2 * WAIT_POLL + 2.0 if self.disturbed else 3.0
            granted = wait_for(lambda: any(w.granted_at is not None for w in waiting), bound)
            assert granted, f"nobody granted {time.monotonic() - released:.2f} s after the release"
            first = next(w for w in waiting if w.granted_at is not None)
            assert first is waiting[0], f"granted {first.index} before {waiting[0].index}: {self.grants}"

    @precondition(lambda self: len(self._waiting()) > 0)
    @rule(data=st.data())
    def give_up(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(self._waiting()))
        waiter.cancel.set()
        ended = wait_for(lambda: waiter.done.is_set() or waiter.granted_at is not None, 5)
        assert ended, "a cancelled waiter did not return"

    @precondition(lambda self: len(self.emptied) < 2)
    @rule(master=st.integers(0, 4))
    def empty_a_master(self, master: int) -> None:
        # At most two distinct masters: three keep every entry, a quorum, so the order holds.
        # Losing entries on a quorum is outside what fair order promises (waiting.md 3.4).
        self.servers[master].flushall()
        self.emptied.add(master)
        self.disturbed = True

    @rule(master=st.integers(0, 4), seconds=st.sampled_from([0.1, 0.4]))
    def pause_a_master(self, master: int, seconds: float) -> None:
        self.servers[master].pause()
        time.sleep(seconds)  # the fault's length, not synchronisation
        self.servers[master].resume()
        self.disturbed = True

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def exclusive(self) -> None:
        assert self.overlaps == 0, f"{self.overlaps} overlapping holds: {self.grants}"

    def teardown(self) -> None:
        try:
            for waiter in self.waiters:
                waiter.cancel.set()
                waiter.release.set()
            for waiter in self.waiters:
                assert waiter.done.wait(10), f"waiter {waiter.index} did not end"
            assert self.overlaps == 0
            pattern = f"redlock:{self.name}*"

            def clean() -> bool:
                for server in self.servers:
                    client = server.client()
                    try:
                        if client.keys(pattern):
                            return False
                    finally:
                        client.close()
                return True

            # Entries of waiters that gave up while a master was paused may wait for their TTL.
            assert wait_for(clean, ENTRY_TTL + 3), "keys left after every waiter ended"
        finally:
            for redlock in self.redlocks:
                redlock.close()


def test_fair_machine(server_set: ServerSet) -> None:
    server_set.ensure_running()
    FairMachine.servers = server_set
    examples = int(os.environ.get("REDLOCK_FAIR_EXAMPLES", "6"))
    run_state_machine_as_test(
        FairMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=14,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )
