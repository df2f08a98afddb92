"""One resource's lock: :class:`Lock`, what :meth:`Redlock.lock` returns.

A Lock asks its :class:`~.redlock.Redlock` for rounds (``try_acquire``, ``try_extend``,
``release_key``) and keeps what they decided: its token, its validity, whether it was lost. A
reentrant lock (:mod:`.reentrant`) is built on it; the Redlock builds both.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from .._fork import on_fork_in_child, pid
from ..errors import RedlockError, Vote
from . import rooms
from .clock import now
from .commands import PLAIN, PLAIN_WAITING, Commands
from .holder import describe_holder
from .state import (
    DEADLINES_SUFFIX,
    FENCE_SUFFIX,
    HOLDER_SEPARATOR,
    KIND_ERROR,
    MAX_NAME_LENGTH,
    QUEUE_SUFFIX,
    RESERVED_SUFFIXES,
    LockState,
    check_wait,
    lock_key,
    raise_on_kind,
)

if TYPE_CHECKING:
    from .fair import Entry
    from .redlock import Redlock
    from .rooms import Waiter
    from .transport.commands import Command

logger = logging.getLogger("celery_redlock.redlock")
# Defined in state.py (shared with the asyncio lock); importable from here as they always were.
__all__ = [
    "DEADLINES_SUFFIX",
    "FENCE_SUFFIX",
    "HOLDER_SEPARATOR",
    "KIND_ERROR",
    "MAX_NAME_LENGTH",
    "QUEUE_SUFFIX",
    "RESERVED_SUFFIXES",
    "Lock",
    "check_wait",
    "lock_key",
    "raise_on_kind",
]


def _nap(until: float, cancelled: Callable[[], bool] | None) -> bool:
    """Sleep until ``until`` (on :func:`.clock.now`), asking ``cancelled`` at least every 0.5 s;
    False if it said to stop."""
    while True:
        remaining = until - now()
        if remaining <= 0:
            return True
        time.sleep(min(remaining, 0.5))
        if cancelled is not None and cancelled():
            return False


# A Lock's mutex is replaced in a forked child on its first use there (see Lock._mutex); this one
# orders two threads of the child that get there at once. It is itself replaced after fork.
_inherited_mutex = threading.Lock()


def _new_inherited_mutex() -> None:
    global _inherited_mutex
    _inherited_mutex = threading.Lock()


on_fork_in_child(_new_inherited_mutex)


class Lock(LockState):
    """One resource's lock on a :class:`Redlock`. Shareable across threads.

    Use ``acquire``/``release`` or ``with``. ``validity`` is how many seconds of guaranteed
    hold are left; act on the resource only while ``owned()`` is true.

    A lock belongs to the process that acquired it. In a forked child, the copy of a lock its
    parent held is not owned (``owned()`` is False, ``validity`` 0, ``token`` None, ``extend()``
    returns False and ``ensure()`` raises :class:`LockLost`), and ``release()`` or leaving a
    ``with`` block (``sys.exit`` in the child unwinds it) sends nothing: the lock stays the
    parent's. The child's copy may be acquired again, as a new lock with a token of the child's
    own, which waits for the parent's release like any other contender.
    """

    # What this kind of lock sends (a subclass may send others: see reentrant.py); and what its
    # attempts send while it waits (refusals then answer the holder's PTTL).
    _commands: Commands = PLAIN
    _waiting_commands: Commands = PLAIN_WAITING
    fenced = False  # whether grants carry a fence (see fencing.py)

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
        self.redlock: Redlock = redlock
        self._op = threading.Lock()
        self._op_pid = pid()  # the process _op was made in

    def __repr__(self) -> str:
        state = f"owned, {self.validity:.3f}s left" if self.owned() else "not owned"
        return f"<Lock {self.name!r} ttl={self.ttl}s {state}>"

    def _mutex(self) -> threading.Lock:
        """The mutex that orders this Lock's operations.

        A forked child gets a new one on first use: another thread of the parent (its heartbeat,
        say) may have held the old one at the fork, and would never release it in the child.
        """
        if self._op_pid != pid():
            with _inherited_mutex:
                if self._op_pid != pid():
                    self._op = threading.Lock()
                    self._op_pid = pid()
        return self._op

    def locked(self) -> bool:
        """Whether a quorum of masters holds this resource, by any token."""
        return self.redlock.holders(self.key) >= self.redlock.quorum

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> bool:
        """Try to take the lock; True once held. Like ``threading.Lock.acquire``.

        ``blocking=False`` tries one round. With ``timeout=None``, a held lock is tried again
        after a random delay in ``[0, retry_delay)``, for ``retry_count`` more attempts. With a
        ``timeout`` (seconds; ``-1`` or ``math.inf``: no limit; 0: one attempt), it waits until
        then: woken by the holder's release when the Redlock's ``wait`` is ``"release"``
        (trying again at least every ``wait_poll``), else polling as above. The call returns
        by the timeout plus one round's ``request_timeout``.

        ``cancelled``, if given, is asked at every wake-up of a wait (at least every 0.5 s);
        when it returns True the call gives up and returns False.
        """
        if timeout is not None or (blocking is not True and blocking is not False):
            timeout = check_wait(blocking, timeout)
        if self._token is not None and self.owned():  # no token: not owned (one read, no call)
            raise RedlockError(f"lock {self.name!r} is already held by this Lock")
        redlock = self.redlock
        deadline = None if timeout is None else now() + timeout
        attempts = 0
        # Set once this call waits in a room of the Redlock's subscriber (see _wait).
        waiter: Waiter | None = None
        expiry: list[float] = []  # when a waiting attempt found a quorum could be free
        entry = self._entry()  # this call's place in a queue (fair.py); None for a plain lock
        acquired = False
        try:
            while True:
                attempts += 1
                if waiter is not None:
                    redlock._subscriber.mark(self.key, waiter)
                votes = self._take(attempts, waiter is not None, expiry, entry)
                if votes is None:
                    acquired = True
                    return True
                if not blocking:
                    return False
                go_on, waiter = self._pause(attempts, deadline, cancelled, waiter, votes, expiry, entry)
                if not go_on:
                    return False
        finally:
            if waiter is not None:
                redlock._subscriber.leave(self.key, waiter)
            if entry is not None and not acquired:
                self._leave(entry)

    def _pause(
        self,
        attempts: int,
        deadline: float | None,
        cancelled: Callable[[], bool] | None,
        waiter: Waiter | None,
        votes: list[Vote],
        expiry: list[float],
        entry: Entry | None,
    ) -> tuple[bool, Waiter | None]:
        """After a refused attempt of a blocking call: whether to try again (once this returns),
        and the room of the Redlock's subscriber this call waits in from now on."""
        redlock = self.redlock
        if deadline is None:
            # No timeout: retried a fixed number of times, after a random delay each.
            if attempts > redlock.retry_count:
                return False, waiter
            time.sleep(random.uniform(0, redlock.retry_delay))
            return True, waiter
        if deadline - now() <= 0 or (cancelled is not None and cancelled()):
            return False, waiter
        if redlock.wait == "poll":
            # A fair waiter that has just learned its ticket joins at once: a nap here would let
            # a later arrival join first (see fair.py, arrival order).
            if entry is not None and self._joins_next(entry):
                return True, waiter
            return _nap(min(deadline, now() + random.uniform(0, redlock.retry_delay)), cancelled), waiter
        if waiter is None:
            # The first refusal: join the key's room, then try again at once (the holder may
            # have released while we subscribed; its notice would predate our mark).
            room = min(deadline, now() + redlock.request_timeout)
            return True, redlock._subscriber.join(self.key, room, None if entry is None else entry.member)
        return self._wait(waiter, votes, deadline, expiry[0] if expiry else math.inf, cancelled), waiter

    def _take(
        self, attempts: int, waiting: bool, expiry: list[float], entry: Entry | None
    ) -> list[Vote] | None:
        """One attempt with a new token: None once held, else the votes that refused it (kept,
        with the attempt's figures, for :attr:`last_error`)."""
        redlock = self.redlock
        token = self._new_token()
        with self._mutex():
            started = now()
            validity, votes, elapsed = self._attempt(token, waiting, expiry, entry)
            self.last_votes = votes
            if validity > 0:
                validity = self._grant(token, started, attempts, elapsed)
                if validity > 0:
                    if entry is not None:
                        self._granted(entry)
                    return None
                # Granted, but run out before it was looked at: a failed attempt, and so
                # retracted like one (nobody has seen it held: no reply is waited for).
                redlock.send_release(
                    self.key, token, commands=self._commands, command=self._retraction(token, entry)
                )
        self._refused(votes)
        self._failed(votes, attempts, elapsed, validity)
        return votes

    # -- what a kind of lock does differently (plain here; see fair.py) -------------------------
    def _entry(self) -> Entry | None:
        """A new acquire call's place in the resource's queue; a plain lock has none."""
        return None

    def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Entry | None
    ) -> tuple[float, list[Vote], float]:
        """One attempt with ``token``: (validity, votes, elapsed), as ``Redlock.try_acquire``.
        A waiting attempt's refusals carry the holder's PTTL, gathered in ``expiry``."""
        if not waiting:
            return self.redlock.try_acquire(self.key, token, self.ttl, self._commands)
        expiry.clear()
        return self.redlock.try_acquire(self.key, token, self.ttl, self._waiting_commands, expiry)

    def _retraction(self, token: str, entry: Entry | None) -> Command | None:
        """What deletes a granted attempt's ``token`` (None: the kind's own release)."""
        return None

    def _granted(self, entry: Entry) -> None:
        """Called holding the mutex once ``entry``'s call acquired the lock."""

    def _joins_next(self, entry: Entry) -> bool:
        """Whether ``entry``'s next attempt must follow at once (a fair waiter's join)."""
        return False

    def _leave(self, entry: Entry) -> None:
        """Called when ``entry``'s call ends without the lock."""

    def _release_command(self, token: str) -> Command | None:
        """What releases the held ``token`` (None: the kind's own release); holding the mutex."""
        return None

    def _wait(
        self,
        waiter: Waiter,
        votes: list[Vote],
        deadline: float,
        free_at: float,
        cancelled: Callable[[], bool] | None,
    ) -> bool:
        """Sleep after a refused attempt until a release may have freed a quorum (how long, and
        for which notices: ``rooms.plan``); False when ``cancelled`` said so."""
        redlock = self.redlock
        plan = rooms.plan(redlock, votes, deadline, free_at, now())
        woken = redlock._subscriber.sleep(
            self.key, waiter, plan.refusers, plan.needed, plan.until, plan.deaf_until, cancelled
        )
        if woken == "cancelled":
            return False
        if woken == "notice" and plan.split:
            spread = rooms.spread(redlock)
            return _nap(min(deadline, now() + spread), cancelled)
        return True

    def _refused(self, votes: list[Vote]) -> None:
        """Called with the votes of each failed attempt: raises when a refusal is one no retry
        will change (the name is held as another kind of lock)."""
        raise_on_kind(self.name, votes)

    def extend(self, ttl: float | None = None) -> bool:
        """Set the lock's TTL to ``ttl`` (default: its own) on a quorum; False if that failed.

        The TTL is replaced, not added to: a shorter ``ttl`` shortens the lock, and does so
        even when the extension fails (see below). A failed extension otherwise leaves the
        validity the lock had; it is lost for good when the masters that no longer hold the
        token leave no quorum possible. A forked child's copy of its parent's lock is never
        extended (False).
        """
        redlock = self.redlock
        ttl = self.ttl if ttl is None else redlock.check_ttl("ttl", ttl)
        if self._owner != pid():
            return False  # not acquired, or acquired by another process (a forked child's copy)
        with self._mutex():
            token = self._extendable()
            if token is None:
                return False
            started = now()
            validity, votes, _ = redlock.try_extend(self.key, token, ttl, self._commands)
            if not self._settle_extension(token, started, ttl, validity, votes):
                return False
        self.extended(ttl)
        return True

    def extended(self, ttl: float) -> None:
        """Called after every successful extension to ``ttl``, by :meth:`extend` and by
        :meth:`Redlock.extend_many` alike, outside the lock's mutex. Does nothing here; a
        subclass that keeps something beside the lock (a leader record) refreshes it here, so
        the heartbeat's batched extensions cannot skip it."""

    def _keep_alive(self, beat: float | None) -> None:
        """Kept by a heartbeat from now (``beat``: see ``_beat``), or no longer (None)."""
        with self._mutex():
            self._beat = beat
            if beat is not None:
                self._valid_until = min(self._valid_until, now() + beat)

    def _give_up(self, reason: str) -> None:
        """Count the lock as lost from now on (``ensure()`` raises ``LockLost(reason)``) though
        its key may still be on the masters: for a holder that will not be extended again (its
        max hold reached), so its body is told before the key can expire under it. The token
        is kept: :meth:`release` still deletes the key."""
        with self._mutex():
            if self._token is not None and not self._lost_reason:
                self._lost_reason = reason

    def release(self) -> bool:
        """Release on every master, and return once a quorum has answered (or after
        ``request_timeout``). Releasing a lock not held (or already gone) does nothing.

        True when the release took effect on a quorum: an acquire that anyone starts after this
        returned is not refused by this lock. False when fewer masters answered in time (the
        lock is no longer ours either way, and its TTL bounds what is left on the masters).
        """
        return self._release(wait=True)

    def release_without_waiting(self) -> None:
        """Send the release and return without reading the replies: a contender that starts
        right after this may still find the lock held for a moment. For code that never hands
        the resource on (a process about to exit); :meth:`release` is what ``with`` uses."""
        self._release(wait=False)

    def _release(self, *, wait: bool) -> bool:
        with self._mutex():
            if self._owner != pid():
                # Not acquired, or a forked child's copy of its parent's lock: that lock is the
                # parent's, and nothing of it is sent from here. The copy forgets the token, so
                # it can be acquired anew as the child's own.
                self._token = None
                return True
            token, self._token = self._token, None
            self._valid_until = 0.0
            self._lost_reason = ""
            self.release_votes = ()  # this release's, if no quorum answers it (see release_key)
            command = self._release_command(token) if token is not None else None
        if token is None:
            return True
        if not wait:
            self.redlock.send_release(self.key, token, commands=self._commands, command=command)
            return True
        return self.redlock.release_key(self.key, token, commands=self._commands, command=command, lock=self)

    def __enter__(self) -> Lock:
        if not self.acquire(self._blocking, self._timeout):
            error = self.last_error
            assert error is not None
            if error.held_by_other:
                # Say who holds it: one more round, on the failure path only.
                text = self.redlock.holder(self.name)
                if text is not None:
                    error = error.naming(describe_holder(text))
            raise error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
