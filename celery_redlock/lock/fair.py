"""Fair locks: waiters queue on the masters and take the lock in the order they arrived.

Made by ``Redlock.lock(name, fair=True)``. The lock itself is a plain lock's string key, taken
and counted exactly as a plain lock's (quorum, validity, retraction): the queue decides only
*who may try*, never whether a grant counts. Beside the key each master keeps a queue (a ZSET
member -> ticket) and each entry's deadline on its own clock (see ``FAIR_ACQUIRE`` in
:mod:`.scripts`). A free lock can be taken on a master only by the head of its queue, and a
release publishes the new head's member, so only that waiter wakes (:mod:`.subscriber`).

Words: a *member* is one acquire call's name in the queue; its *ticket* is its place, the same
number on every master; an *entry* is the member on one master, with its deadline.

**Tickets need no clock** (after Lamport's bakery). An acquire call's first attempt is a
*probe*: it takes the lock only if it is free and nobody queues, and every refusal carries that
master's highest ticket + 1. The waiter takes the largest over the masters that answered and
*joins* with it everywhere, in its next attempt, which follows at once in either wait mode
(``"release"`` or ``"poll"``). INVARIANT (arrival order): if A's join was
acknowledged by a quorum before B's probe began, B's probe met a master that holds A's entry,
so B's ticket is larger than A's, on every master. Arrivals that overlap get some order, but
the same one everywhere: equal tickets sort by member.

**A dead waiter cannot block the queue.** An entry expires ``entry_ttl`` after its waiter's
last attempt (``max(2 s, 4 * wait_poll, 2 * retry_delay)``; a waiter tries at least every
``wait_poll``, or within ``retry_delay`` when it polls), and
every attempt first drops expired entries. A waiter that was paused past its deadline has lost
its place: its next attempt (``keep``) does not queue it again, and when a quorum says so it
takes a new ticket at the back.

**When the masters disagree** on who is head (an entry missing on a master that was down
during the join, entries expiring at different times, a master restarted empty), the attempts
do what they always do: a quorum of grants wins, anything less is retracted. Disagreement can
cost order and time (at most until the stale entries expire), never exclusion. Each attempt's
replies carry the member's rank on every master, which the benchmarks report.

Plain locks on a fair name take it without queueing (they exclude each other, the queue is
only skipped); reentrant and fair are not combined (ConfigError).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import Vote
from . import scripts
from .commands import milliseconds
from .resource import DEADLINES_SUFFIX, QUEUE_SUFFIX, Lock
from .transport.commands import Command, Outcome, script_template

if TYPE_CHECKING:
    from .redlock import Redlock
    from .settings import Settings

# (key, queue, deadlines, token, ttl ms, member, ticket, entry ttl ms, mode)
ACQUIRE = script_template(scripts.FAIR_ACQUIRE, 3, 6)
RELEASE = script_template(scripts.FAIR_RELEASE, 3, 3)  # key queue deadlines token member leave(1/0)

# An entry outlives its waiter's last attempt by at least this long (seconds).
MIN_ENTRY_TTL = 2.0


@dataclass
class Entry:
    """One acquire call's place in the queue, as far as its replies told."""

    member: str
    ticket: int = 0  # 0 until a probe told the next ticket
    placed: set[int] = field(default_factory=set)  # the masters that acknowledged the entry
    ranks: list[int] = field(default_factory=list)  # the latest rank on each master (-1: none)
    attempts: int = 0


class Queue:
    """One fair lock's queue rules, whatever carries its rounds (the threaded :class:`FairLock`
    and the asyncio ``AsyncFairLock`` each keep one): what an attempt sends, what its replies
    teach, what retracts, leaves and releases."""

    def __init__(self, redlock: Settings, key: str, ttl: float) -> None:
        self.redlock = redlock
        self.keys = (key, key + QUEUE_SUFFIX, key + DEADLINES_SUFFIX)
        self.ttl = ttl
        # A waiter tries again at least every wait_poll when woken by releases, and within
        # retry_delay when it polls: its entry outlives either, several times over.
        self.entry_ttl = max(MIN_ENTRY_TTL, 4 * redlock.wait_poll, 2 * redlock.retry_delay)
        self.member: str | None = None  # the member of the call that holds the lock

    def timeout(self, blocking: bool, timeout: float | None) -> float | None:
        """A blocking acquire without a timeout waits in the queue as long as a plain lock's
        retries take (see ``FairLock``)."""
        if blocking and timeout is None:
            return (self.redlock.retry_count + 1) * self.redlock.retry_delay
        return timeout

    def entry(self) -> Entry:
        return Entry(os.urandom(12).hex())

    def acquires(self, token: str, entry: Entry) -> tuple[list[str], list[Command]]:
        """One attempt's mode per master (probe, join or keep) and the command each is sent."""
        n = len(self.redlock.masters)
        ttl_ms = milliseconds(self.ttl)
        entry_ms = milliseconds(self.entry_ttl)
        if not entry.ticket:
            modes = ["probe"] * n
        else:
            modes = ["keep" if i in entry.placed else "join" for i in range(n)]
        packed = {
            mode: ACQUIRE.pack(*self.keys, token, ttl_ms, entry.member, entry.ticket, entry_ms, mode)
            for mode in set(modes)
        }
        return modes, [packed[mode] for mode in modes]

    def take_in(self, entry: Entry, modes: list[str], outcomes: list[Outcome]) -> None:
        """Update ``entry`` from one attempt's replies: where it is queued, and its ticket."""
        entry.attempts += 1
        after = 0
        gone = 0
        answered = 0
        ranks = []
        for i, (mode, outcome) in enumerate(zip(modes, outcomes, strict=True)):
            value = outcome.value if outcome.kind == "ok" else None
            if isinstance(value, list) and len(value) == 4:
                answered += 1
                after = max(after, int(value[1]))
                ranks.append(int(value[2]))
                if mode == "join":
                    entry.placed.add(i)
                elif mode == "keep" and not value[3]:
                    entry.placed.discard(i)  # expired there: this master no longer queues it
                    gone += 1
            else:
                ranks.append(0 if value == b"OK" else -1)
                if value == b"OK":
                    answered += 1
                    after = max(after, 1)  # a probe's grant: nobody queued there
                    if mode == "join":
                        entry.placed.add(i)
        entry.ranks = ranks
        if gone >= self.redlock.quorum:
            # The entry expired on a quorum (this waiter was paused past its deadline): its
            # place is lost, and it queues again at the back.
            entry.ticket = 0
            entry.placed.clear()
        # INVARIANT (arrival order): a ticket is taken only from a quorum's answers, which meet
        # every entry a quorum acknowledged before this attempt began; from a minority it could
        # land ahead of such an entry (an empty minority answers 1). Else: probe again.
        if not entry.ticket and after and answered >= self.redlock.quorum:
            entry.ticket = after

    def retraction(self, token: str, entry: Entry) -> Command:
        return RELEASE.pack(*self.keys, token, entry.member, "0")

    def joins_next(self, entry: Entry) -> bool:
        # Probed and given a ticket, queued nowhere yet: the join goes at once, in both wait
        # modes, so arrival order is the order of the probes' quorums (the INVARIANT above).
        return bool(entry.ticket) and not entry.placed

    def leaving(self, entry: Entry) -> Command | None:
        """What a call that ends without the lock sends (not waited for), if anything."""
        if entry.ticket:  # it may have joined somewhere (a timed-out join may have landed)
            return RELEASE.pack(*self.keys, "", entry.member, "1")
        return None

    def release(self, token: str) -> Command:
        """What releases the held ``token``, and leaves the queue."""
        member, self.member = self.member, None
        return RELEASE.pack(*self.keys, token, member or "", "1")


class FairLock(Lock):
    """A :class:`Lock` whose waiters take it in arrival order (see the module docstring).

    ``acquire(timeout=None)`` waits in the queue up to ``(retry_count + 1) * retry_delay``,
    the longest a plain lock's retries take; pass a ``timeout`` to wait longer. A non-blocking
    acquire never queues: it takes the lock only if it is free and nobody waits.
    """

    def __init__(
        self,
        redlock: Redlock,
        name: str,
        ttl: float | None = None,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
    ) -> None:
        super().__init__(redlock, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        self._queue = Queue(redlock, self.key, self.ttl)
        self.entry_ttl = self._queue.entry_ttl

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> bool:
        return super().acquire(blocking, self._queue.timeout(blocking, timeout), cancelled=cancelled)

    def _entry(self) -> Entry:
        return self._queue.entry()

    def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Entry | None
    ) -> tuple[float, list[Vote], float]:
        assert entry is not None
        modes, acquires = self._queue.acquires(token, entry)
        seen: list[Outcome] = []
        expiry.clear()
        result = self.redlock.try_acquire(
            self.key,
            token,
            self.ttl,
            expiry=expiry,
            acquires=acquires,
            retraction=self._queue.retraction(token, entry),
            seen=seen,
        )
        self._queue.take_in(entry, modes, seen)
        return result

    def _retraction(self, token: str, entry: Entry | None) -> Command | None:
        assert entry is not None
        return self._queue.retraction(token, entry)

    def _granted(self, entry: Entry) -> None:
        self._queue.member = entry.member

    def _joins_next(self, entry: Entry) -> bool:
        return self._queue.joins_next(entry)

    def _leave(self, entry: Entry) -> None:
        command = self._queue.leaving(entry)
        if command is not None:
            self.redlock.send_release(self.key, "", command=command)

    def _release_command(self, token: str) -> Command | None:
        return self._queue.release(token)
