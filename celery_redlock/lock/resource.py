"""One resource's lock: :class:`Lock`, what :meth:`Redlock.lock` returns.

A Lock asks its :class:`~.redlock.Redlock` for rounds (``try_acquire``, ``try_extend``,
``release_key``) and keeps what they decided: its token, its validity, whether it was lost. A
reentrant lock (:mod:`.reentrant`) is built on it; the Redlock builds both.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._fork import on_fork_in_child, pid
from .._validate import flag, wait_timeout
from ..errors import ConfigError, LockKindMismatch, LockLost, LockNotAcquired, NotFenced, RedlockError, Vote
from .clock import now
from .commands import PLAIN, PLAIN_WAITING, Commands
from .holder import describe_holder

if TYPE_CHECKING:
    from .fair import Entry
    from .redlock import Redlock
    from .subscriber import Waiter
    from .transport.commands import Command

logger = logging.getLogger("celery_redlock.redlock")

# Names longer than this are shortened to a readable head plus a digest of the whole name.
MAX_NAME_LENGTH = 512

# Between a token's random part and the holder text stored with it (see Redlock.lock).
HOLDER_SEPARATOR = "|"

# The keys some kinds of lock keep beside the lock key: a fair lock's queue and its entries'
# deadlines (fair.py), a fenced lock's counter (fencing.py). No lock name may end in one, so no
# lock's key is ever another lock's sibling (a shortened name ends in hex digits, never so).
QUEUE_SUFFIX = "~queue"
DEADLINES_SUFFIX = "~deadlines"
FENCE_SUFFIX = "~fence"
RESERVED_SUFFIXES = (QUEUE_SUFFIX, DEADLINES_SUFFIX, FENCE_SUFFIX)


def lock_key(prefix: str, name: object) -> str:
    """The key a resource name is stored under; over-long names keep a head and a digest."""
    if not isinstance(name, str):
        raise ConfigError(f"lock name must be a str, got {type(name).__name__}: {name!r}")
    if not name:
        raise ConfigError("lock name must not be empty")
    if name.endswith(RESERVED_SUFFIXES):
        raise ConfigError(
            f"lock name {name!r} ends in {name[name.rindex('~') :]!r}, which is reserved for the keys "
            f"kept beside a lock ({', '.join(RESERVED_SUFFIXES)})"
        )
    if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        name = f"{name[:64]}~sha256:{digest}"
    return prefix + name


# The prefix of the error a script answers when a name is held as another kind of lock.
KIND_ERROR = "REDLOCK_KIND"


def raise_on_kind(name: str, votes: list[Vote]) -> None:
    """Raise :class:`LockKindMismatch` if any master said ``name`` is held as another kind of
    lock: reentrant locks are hashes on the masters, plain and fair locks strings."""
    for vote in votes:
        if vote.kind == "error" and KIND_ERROR in vote.detail:
            mixed = [v.master for v in votes if v.kind == "error" and KIND_ERROR in v.detail]
            raise LockKindMismatch(
                f"lock {name!r}: {vote.detail.partition(KIND_ERROR)[2].strip()} on {', '.join(mixed)}; "
                "a name must be used either reentrant=True everywhere or nowhere"
            )


def check_wait(blocking: object, timeout: object) -> float | None:
    """``acquire``'s ``timeout`` as seconds (None: retry_count tries), else a :class:`ConfigError`
    naming the argument: a ``blocking`` that is not a bool (``"no"`` is true, and would wait)."""
    if blocking is not True and blocking is not False:
        flag("blocking", blocking)
    if timeout is None:
        return None
    if not blocking:
        raise ConfigError("timeout cannot be given with blocking=False")
    return wait_timeout("timeout", timeout)


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


class Lock:
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
    # Every master's vote on the last release that no quorum answered (empty after one that a
    # quorum did): what names the masters in a warning. Set on the failure path only.
    release_votes: Sequence[Vote] = ()

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
        self.redlock = redlock
        self.key = lock_key(redlock.key_prefix, name)
        self.name = name
        self.ttl = redlock.ttl if ttl is None else redlock.check_ttl("ttl", ttl)
        # Checked now, not at the first ``with``, so a bad value fails where it was written.
        self._timeout = None if timeout is None else wait_timeout("timeout", timeout)
        self._blocking = flag("blocking", blocking)
        if not isinstance(holder, str) or "\n" in holder or "\r" in holder:
            raise ConfigError(f"holder must be a str without line breaks, got {holder!r}")
        # Appended to every token of this lock: the token stays unique per acquisition (its
        # random part), and the stored value also says who took it, in the same SET.
        self._holder_suffix = HOLDER_SEPARATOR + holder if holder else ""
        self._token: str | None = None
        self._owner = 0  # the pid of the process that acquired the token (see _fork.pid)
        self._valid_until = 0.0
        self._lost_reason = ""
        # Kept by a heartbeat: how long after an extension's start the lock still counts as
        # owned without another (see Heartbeat.keep); None when not kept.
        self._beat: float | None = None
        self._op = threading.Lock()
        self._op_pid = pid()  # the process _op was made in
        self.last_votes: list[Vote] = []
        self.last_attempts = 0  # how many attempts the latest acquire made
        self._failure: tuple[Any, ...] | None = None
        self._last_error: LockNotAcquired | None = None

    def __repr__(self) -> str:
        state = f"owned, {self.validity:.3f}s left" if self.owned() else "not owned"
        return f"<Lock {self.name!r} ttl={self.ttl}s {state}>"

    @property
    def last_error(self) -> LockNotAcquired | None:
        """Why the last acquisition failed (None after a success)."""
        if self._last_error is None and self._failure is not None:
            votes, attempts, elapsed, validity = self._failure
            self._last_error = LockNotAcquired(
                self.name,
                votes,
                attempts=attempts,
                elapsed=elapsed,
                validity=validity,
                quorum=self.redlock.quorum,
            )
        return self._last_error

    @property
    def token(self) -> str | None:
        """The token this process holds the lock by (None if it does not hold it): 40 random hex
        digits, unique per acquisition, then ``HOLDER_SEPARATOR`` and the holder text if any."""
        return self._token if self._owner == pid() else None

    @property
    def fence(self) -> int | None:
        """A fenced lock's fence (see :mod:`.fencing`); on any other lock :class:`NotFenced`,
        rather than a None that would only fail later, inside the user's write."""
        raise NotFenced(
            f"lock {self.name!r} was not taken with fenced=True, so it has no fence: pass fenced=True "
            "to Redlock.lock(), or set lock_fenced=True on the task (redlock_fenced app-wide)"
        )

    @property
    def validity(self) -> float:
        # pid() reads a variable (no system call): a forked child's copy is not owned.
        if self._token is None or self._lost_reason or self._owner != pid():
            return 0.0
        return max(0.0, self._valid_until - now())

    @property
    def lost_reason(self) -> str:
        """Why the lock was lost ("" while held or never acquired)."""
        return self._lost_reason

    def owned(self) -> bool:
        return self.validity > 0.0

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
        if self.owned():
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
        # 20 bytes from the operating system's CSPRNG (what the secrets module reads too).
        token = os.urandom(20).hex() + self._holder_suffix
        with self._mutex():
            started = now()
            validity, votes, elapsed = self._attempt(token, waiting, expiry, entry)
            self.last_votes = votes
            if validity > 0:
                # Anchored before the round, never when its result is looked at: a holder
                # stalled in between (a long GC, a SIGSTOP) must not come back believing it
                # holds what the masters already let expire. So True here implies owned().
                # One more clock read (81 ns, no system call).
                valid_until = started + self.ttl - redlock.drift(self.ttl)
                validity = valid_until - now()
                if validity > 0:
                    self._token = token
                    self._owner = pid()
                    self._valid_until = valid_until
                    self._lost_reason = ""
                    self._failure = self._last_error = None
                    self.last_attempts = attempts
                    if entry is not None:
                        self._granted(entry)
                    logger.debug(
                        "acquired %s in %.2f ms (validity %.3f s)", self.key, elapsed * 1000, validity
                    )
                    return None
                # Granted, but run out before it was looked at: a failed attempt, and so
                # retracted like one (nobody has seen it held: no reply is waited for).
                redlock.send_release(
                    self.key, token, commands=self._commands, command=self._retraction(token, entry)
                )
        self._refused(votes)
        # Built only when asked for: a contended loop fails far more often than it looks.
        self._failure = (votes, attempts, elapsed, validity)
        self.last_attempts = attempts
        self._last_error = None
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
        """Sleep after a refused attempt until a release may have freed a quorum; False when
        ``cancelled`` said so.

        The attempt was granted by ``yes`` masters (and retracted); ``quorum - yes`` of those
        that refused it must free the key before a new attempt can win, so that many notices
        are waited for. Waking on any one notice would make every split vote's retraction (each
        retraction that deleted publishes) wake every waiter. Never longer than a jittered
        ``wait_poll``: a notice may be lost; and no longer than a poll's delay when too few of
        the refusing masters listened to wake it.
        """
        redlock = self.redlock
        yes = sum(1 for vote in votes if vote.kind == "yes")
        refusers = frozenset(i for i, vote in enumerate(votes) if vote.kind == "held")
        needed = max(1, redlock.quorum - yes)
        t = now()
        # Also woken when the holder's lock runs out on a quorum (an abandoned lock expires).
        until = min(deadline, free_at, t + random.uniform(0.5, 1.0) * redlock.wait_poll)
        deaf_until = t + random.uniform(0, redlock.retry_delay)
        woken = redlock._subscriber.sleep(self.key, waiter, refusers, needed, until, deaf_until, cancelled)
        if woken == "cancelled":
            return False
        if woken == "notice" and yes:
            # After a split vote, the losers spread their next tries as polling does, but never
            # past the bound a waiter keeps (wait_poll) nor unasked whether to go on.
            spread = random.uniform(0, min(redlock.retry_delay, redlock.wait_poll / 2))
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

    def _extendable(self) -> str | None:
        """The token to extend, or None when there is nothing to extend (call holding the mutex;
        :meth:`Redlock.extend_many` asks the same)."""
        token = self._token
        if token is None or self._lost_reason or not self.owned():
            return None
        return token

    def _settle_extension(
        self, token: str, started: float, ttl: float, validity: float, votes: list[Vote]
    ) -> bool:
        """Record the outcome of extending ``token`` to ``ttl`` in a round started at
        ``started`` (on :func:`.clock.now`) that left ``validity``; True if the lock was extended.

        Called holding the mutex, for an extension by this process (see :meth:`extend`).
        """
        self.last_votes = votes
        # INVARIANT: whatever the attempt returns, the validity afterwards never exceeds what
        # the new TTL allows, counted from before the round. Any master may have applied it:
        # those that said yes did, and one that timed out may yet, when its reply is late (a
        # paused master resumes). PEXPIRE replaces the TTL, so a shorter one ends the keys
        # sooner than the validity we had, granted or not.
        limit = started + ttl - self.redlock.drift(ttl)
        if self._beat is not None:
            limit = min(limit, started + self._beat)  # see _beat
        if validity > 0 and self._token == token and limit > now():
            self._valid_until = limit
            return True
        self._valid_until = min(self._valid_until, limit)
        gone = sum(1 for v in votes if v.kind == "held")
        if gone > len(votes) - self.redlock.quorum:
            self._lost_reason = f"{gone} of {len(votes)} masters no longer hold this token"
        logger.debug("extension of %s failed: %s", self.key, "; ".join(map(str, votes)))
        return False

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

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock is still owned."""
        if not self.owned():
            if self._token is not None and self._owner != pid():
                reason = (
                    f"it belongs to another process (pid {self._owner}, which acquired it); "
                    "a forked child does not own its parent's locks"
                )
            elif self._token is not None:
                reason = self._lost_reason or "validity ran out"
            else:
                reason = self._lost_reason or "not acquired"
            raise LockLost(self.name, reason)

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
