"""``AsyncLock``: one resource's lock for asyncio code (what ``AsyncRedlock.lock`` returns).

The state and its rules (token, validity anchored before the granting round, extension
settling, loss) are :class:`..state.LockState`'s, shared with the threaded ``Lock``; the rounds
are :mod:`..rounds`'. What is asyncio's own here: the retry loop's sleeps (``asyncio.sleep``),
the mutex (an ``asyncio.Lock``), cancellation, and the keep-alive task.

Cancellation: an ``acquire()`` cancelled mid-round retracts on every master (the round's undo,
written before the cancellation goes on: see ``exchange.drive``); a cancelled ``extend()``
leaves the validity no longer than the new TTL allows, as a failed one does; leaving
``async with`` by a cancellation still releases (the release is written at once, whether or not
its replies are then waited for).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..._fork import pid
from ..._validate import flag
from ...errors import LockNotAcquired, RedlockError, Vote
from .. import rooms
from ..clock import now
from ..commands import PLAIN, PLAIN_WAITING, Commands
from ..fencing import fenced_attempt
from ..heartbeat import MIN_RETRY, RETRY_FRACTION, longest_interval
from ..holder import describe_holder
from ..rooms import Waiter
from ..rounds import attempt
from ..state import LockState, check_wait, raise_on_kind
from ..transport.commands import Command

if TYPE_CHECKING:
    from .redlock import AsyncRedlock

logger = logging.getLogger("celery_redlock.aio.lock")


class AsyncLock(LockState):
    """One resource's lock on an :class:`~.redlock.AsyncRedlock`; use ``await acquire()`` /
    ``await release()`` or ``async with``. ``owned()``, ``validity`` and ``ensure()`` answer as
    ``Lock``'s do. With ``keepalive``, ``lost`` is set once the lock is lost."""

    _commands: Commands = PLAIN  # what it is taken, extended and released with
    # What its attempts send while it waits (refusals then answer the holder's PTTL).
    _waiting_commands: Commands = PLAIN_WAITING

    def __init__(
        self,
        redlock: AsyncRedlock,
        name: str,
        ttl: float | None = None,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
        fenced: bool = False,
        keepalive: bool = False,
    ) -> None:
        super().__init__(redlock, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        self.redlock: AsyncRedlock = redlock
        self.fenced = flag("fenced", fenced)
        self.keepalive = flag("keepalive", keepalive)
        self._fence: int | None = None
        self._op = asyncio.Lock()
        self._keeper: asyncio.Task[None] | None = None
        # Set when the keep-alive finds the lock lost (see ensure() for asking at any time).
        self.lost = asyncio.Event()
        if keepalive:
            self._interval = min(
                self.ttl / 3, longest_interval(self.ttl, redlock.request_timeout, redlock.drift(self.ttl))
            )
            if self._interval <= 0:
                raise RedlockError(f"lock {name!r}: ttl {self.ttl:g} s is too short to be kept alive")

    def __repr__(self) -> str:
        state = f"owned, {self.validity:.3f}s left" if self.owned() else "not owned"
        return f"<AsyncLock {self.name!r} ttl={self.ttl}s {state}>"

    @property
    def fence(self) -> int | None:
        """A fenced lock's fence for its current grant (see ``FencedLock.fence``)."""
        if not self.fenced:
            return super().fence
        return self._fence if self._owner == pid() else None

    # -- acquire --------------------------------------------------------------------------------------
    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; True once held. ``Lock.acquire``'s arguments and waits: without a
        ``timeout``, a refused attempt is tried again after a random delay in
        ``[0, retry_delay)``, ``retry_count`` times; with one, the wait is woken by the holder's
        release when the AsyncRedlock's ``wait`` is ``"release"`` (trying again at least every
        ``wait_poll``, and when a quorum's keys could have expired), else it polls. Returns by
        the timeout plus one round's ``request_timeout``."""
        if timeout is not None or (blocking is not True and blocking is not False):
            timeout = check_wait(blocking, timeout)
        if self.owned():
            raise RedlockError(f"lock {self.name!r} is already held by this AsyncLock")
        subscriber = self.redlock.subscriber
        deadline = None if timeout is None else now() + timeout
        attempts = 0
        waiter: Waiter | None = None  # set once this call waits in a room (see _pause)
        expiry: list[float] = []  # when a waiting attempt found a quorum could be free
        entry = self._entry()  # this call's place in a queue (a fair lock's); None here
        acquired = False
        try:
            while True:
                attempts += 1
                if waiter is not None:
                    subscriber.mark(self.key, waiter)
                votes = await self._take(attempts, waiter is not None, expiry, entry)
                if votes is None:
                    acquired = True
                    self._start_keeper()
                    return True
                if not blocking:
                    return False
                go_on, waiter = await self._pause(attempts, deadline, waiter, votes, expiry, entry)
                if not go_on:
                    return False
        finally:
            # Also on a cancellation: neither needs an await (see AsyncExchange.send).
            if waiter is not None:
                subscriber.leave(self.key, waiter)
            if entry is not None and not acquired:
                self._leave(entry)

    async def _pause(
        self,
        attempts: int,
        deadline: float | None,
        waiter: Waiter | None,
        votes: list[Vote],
        expiry: list[float],
        entry: Any,
    ) -> tuple[bool, Waiter | None]:
        """After a refused attempt of a blocking call, by ``Lock._pause``'s rules: whether to try
        again (once this returns), and the room this call waits in from now on."""
        redlock = self.redlock
        if deadline is None:
            if attempts > redlock.retry_count:
                return False, waiter
            await asyncio.sleep(random.uniform(0, redlock.retry_delay))
            return True, waiter
        left = deadline - now()
        if left <= 0:
            return False, waiter
        if redlock.wait == "poll":
            # A fair waiter that has just learned its ticket joins at once (see fair.py).
            if entry is None or not self._joins_next(entry):
                await asyncio.sleep(min(left, random.uniform(0, redlock.retry_delay)))
            return True, waiter
        if waiter is None:
            # The first refusal: join the key's room, then try again at once (the holder may
            # have released while we subscribed; its notice would predate our mark).
            room = now() + min(left, redlock.request_timeout)
            member = getattr(entry, "member", None)
            return True, await redlock.subscriber.join(self.key, room, member)
        plan = rooms.plan(redlock, votes, deadline, expiry[0] if expiry else math.inf, now())
        woken = await redlock.subscriber.sleep(waiter, plan)
        if woken and plan.split:
            await asyncio.sleep(max(0.0, min(deadline - now(), rooms.spread(redlock))))
        return True, waiter

    async def _take(self, attempts: int, waiting: bool, expiry: list[float], entry: Any) -> list[Vote] | None:
        """One attempt with a new token: None once held, else the votes that refused it."""
        token = self._new_token()
        op = self._op
        # What ``async with op`` does, without its two coroutines of its own (the hot path).
        await op.acquire()
        try:
            started = now()
            validity, votes, elapsed, fence = await self._attempt(token, waiting, expiry, entry)
            self.last_votes = votes
            if validity > 0:
                validity = self._grant(token, started, attempts, elapsed)
                if validity > 0:
                    self._fence = fence if self.fenced else None
                    self._granted(entry)
                    self.lost.clear()
                    return None
                # Granted, but run out before it was looked at: retracted as a failed attempt.
                self.redlock.send_release(self._retraction(token, entry))
        finally:
            op.release()
        raise_on_kind(self.name, votes)
        self._failed(votes, attempts, elapsed, validity)
        return votes

    # -- what a kind of lock does differently (plain and fenced here; see fair.py) ------------------
    def _entry(self) -> Any:
        """A new acquire call's place in the resource's queue; None but for a fair lock."""
        return None

    async def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Any
    ) -> tuple[float, list[Vote], float, int]:
        """One attempt with ``token``: (validity, votes, elapsed, fence). A waiting attempt's
        refusals carry the holder's PTTL, gathered in ``expiry``."""
        redlock = self.redlock
        if self.fenced:
            fenced = fenced_attempt(redlock, self.key, token, self.ttl, expiry if waiting else None)
            return await redlock.run(fenced)
        if not waiting:
            steps = attempt(redlock, self.key, token, self.ttl, self._commands)
        else:
            expiry.clear()
            steps = attempt(redlock, self.key, token, self.ttl, self._waiting_commands, expiry)
        validity, votes, elapsed = await redlock.run(steps)
        return validity, votes, elapsed, 0

    def _retraction(self, token: str, entry: Any) -> Command:
        """What deletes a granted attempt's ``token``."""
        return self._commands_release(token)

    def _granted(self, entry: Any) -> None:
        """Called holding the mutex once ``entry``'s call acquired the lock."""

    def _joins_next(self, entry: Any) -> bool:
        """Whether ``entry``'s next attempt must follow at once (a fair waiter's join)."""
        return False

    def _leave(self, entry: Any) -> None:
        """Called when ``entry``'s call ends without the lock (nothing awaited)."""

    def _commands_release(self, token: str) -> Command:
        """What releases the held ``token`` (a plain lock's, and a fenced one's, release)."""
        return self._commands.release.pack(self.key, token)

    # -- extend and release ---------------------------------------------------------------------------
    async def extend(self, ttl: float | None = None) -> bool:
        """Set the TTL to ``ttl`` (default: its own) on a quorum (``Lock.extend``'s rules)."""
        ttl = self.ttl if ttl is None else self.redlock.check_ttl("ttl", ttl)
        if self._owner != pid():
            return False
        async with self._op:
            token = self._extendable()
            if token is None:
                return False
            started = now()
            try:
                validity, votes, _ = await self.redlock.try_extend(self.key, token, ttl, self._commands)
            except asyncio.CancelledError:
                # Any master may have applied it: settled as a failed extension (the validity
                # is then no longer than the new TTL allows, counted from before the round).
                self._settle_extension(token, started, ttl, 0.0, list(self.redlock.tally.granted))
                raise
            return self._settle_extension(token, started, ttl, validity, votes)

    async def release(self) -> bool:
        """Release on every master and return once a quorum answered (``Lock.release``'s
        answer). Releasing a lock not held does nothing."""
        self._stop_keeper()
        if self._owner != pid():
            self._token = None
            return True
        token, self._token = self._token, None
        self._valid_until = 0.0
        self._lost_reason = ""
        self._fence = None
        self.release_votes = ()
        if token is None:
            return True
        votes = await self.redlock.release_key(self._commands_release(token))
        if votes is None:
            return True
        self.release_votes = votes
        return False

    # -- keep-alive -----------------------------------------------------------------------------------
    def _start_keeper(self) -> None:
        if not self.keepalive:
            return
        task = asyncio.get_running_loop().create_task(self._keep(), name=f"redlock-keepalive {self.name}")
        self._keeper = task
        self.redlock.keepalives.add(task)
        task.add_done_callback(self.redlock.keepalives.discard)

    def _stop_keeper(self) -> None:
        task, self._keeper = self._keeper, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _keep(self) -> None:
        """Extend every interval while held; after a failure, retry sooner while validity is
        left (as the threaded heartbeat does); set ``lost`` once it is lost."""
        delay = self._interval
        while True:
            await asyncio.sleep(delay)
            if self._token is None:
                return
            if await self.extend():
                delay = self._interval
                continue
            left = self.validity
            if left <= 0 or self._lost_reason:
                if not self._lost_reason:
                    self._lost_reason = "validity ran out: the keep-alive's extensions failed"
                logger.warning("lock %s lost: %s", self.key, self._lost_reason)
                self.lost.set()
                return
            delay = max(MIN_RETRY, left * RETRY_FRACTION)

    # -- async with -----------------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncLock:
        if not await self.acquire(self._blocking, self._timeout):
            raise await named(self.redlock, self.name, self.last_error)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


async def named(redlock: AsyncRedlock, name: str, error: LockNotAcquired | None) -> LockNotAcquired:
    """``error``, saying who holds the lock when another holder refused it (one more round, on
    the failure path only), as the threaded ``with`` raises it."""
    assert error is not None
    if error.held_by_other:
        text = await redlock.holder(name)
        if text is not None:
            return error.naming(describe_holder(text))
    return error
