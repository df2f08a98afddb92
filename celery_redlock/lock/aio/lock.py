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
import random
from types import TracebackType
from typing import TYPE_CHECKING

from ..._fork import pid
from ..._validate import flag
from ...errors import RedlockError, Vote
from ..clock import now
from ..commands import PLAIN, Commands
from ..fencing import fenced_attempt
from ..heartbeat import MIN_RETRY, RETRY_FRACTION, longest_interval
from ..state import LockState, check_wait, raise_on_kind

if TYPE_CHECKING:
    from .redlock import AsyncRedlock

logger = logging.getLogger("celery_redlock.aio.lock")


class AsyncLock(LockState):
    """One resource's lock on an :class:`~.redlock.AsyncRedlock`; use ``await acquire()`` /
    ``await release()`` or ``async with``. ``owned()``, ``validity`` and ``ensure()`` answer as
    ``Lock``'s do. With ``keepalive``, ``lost`` is set once the lock is lost."""

    _commands: Commands = PLAIN  # what it is taken, extended and released with

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
        """Take the lock; True once held (``Lock.acquire``'s arguments and waits, polling: a
        refused attempt is tried again after a random delay in ``[0, retry_delay)``, and no
        later than when a quorum's keys could have expired)."""
        if timeout is not None or (blocking is not True and blocking is not False):
            timeout = check_wait(blocking, timeout)
        if self.owned():
            raise RedlockError(f"lock {self.name!r} is already held by this AsyncLock")
        deadline = None if timeout is None else now() + timeout
        attempts = 0
        while True:
            attempts += 1
            votes = await self._take(attempts)
            if votes is None:
                self._start_keeper()
                return True
            if not blocking:
                return False
            delay = self._pause(attempts, deadline)
            if delay is None:
                return False
            await asyncio.sleep(delay)

    def _pause(self, attempts: int, deadline: float | None) -> float | None:
        """How long to wait before the next attempt (None: give up), by ``Lock._pause``'s rules
        for a polling wait."""
        redlock = self.redlock
        if deadline is None:
            return None if attempts > redlock.retry_count else random.uniform(0, redlock.retry_delay)
        left = deadline - now()
        if left <= 0:
            return None
        return min(left, random.uniform(0, redlock.retry_delay))

    async def _take(self, attempts: int) -> list[Vote] | None:
        """One attempt with a new token: None once held, else the votes that refused it."""
        token = self._new_token()
        async with self._op:
            started = now()
            fence = 0
            if self.fenced:
                steps = fenced_attempt(self.redlock, self.key, token, self.ttl)
                validity, votes, elapsed, fence = await self.redlock.run(steps)
            else:
                validity, votes, elapsed = await self.redlock.try_acquire(
                    self.key, token, self.ttl, self._commands
                )
            self.last_votes = votes
            if validity > 0:
                if self._grant(token, started, attempts, elapsed):
                    self._fence = fence if self.fenced else None
                    self.lost.clear()
                    return None
                # Granted, but run out before it was looked at: retracted as a failed attempt.
                self.redlock.send_release(self._commands_release(token))
        raise_on_kind(self.name, votes)
        self._failed(votes, attempts, elapsed, validity)
        return votes

    def _commands_release(self, token: str) -> bytes:
        """What releases ``token``: a plain lock's (and a fenced one's) release."""
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
            error = self.last_error
            assert error is not None
            raise error
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()
