"""What a held lock knows, whatever carries its rounds: its key, token, validity and loss.

:class:`LockState` is the part of a lock that does no I/O: the arguments checked where they were
written, the token (unique per acquisition), the validity anchored before the round that
granted it, the rules that settle an extension, and why the lock was lost. The threaded
:class:`~.resource.Lock` and the asyncio :class:`~.asyncio.lock.AsyncLock` are both built on
it, so a grant and an extension are judged by one copy of each rule.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._fork import pid
from .._validate import flag, wait_timeout
from ..errors import ConfigError, LockKindMismatch, LockLost, LockNotAcquired, NotFenced, Vote
from .clock import now
from .holder import HOLDER_SEPARATOR as HOLDER_SEPARATOR  # importable here, as it always was

if TYPE_CHECKING:
    from .settings import Settings

logger = logging.getLogger("celery_redlock.redlock")

# Names longer than this are shortened to a readable head plus a digest of the whole name.
MAX_NAME_LENGTH = 512


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


class LockState:
    """One resource's lock as its holder knows it (see the module docstring); the I/O is the
    subclass's. A lock belongs to the process that acquired it (see ``Lock``)."""

    # Every master's vote on the last release that no quorum answered (empty after one that a
    # quorum did): what names the masters in a warning. Set on the failure path only.
    release_votes: Sequence[Vote] = ()

    def __init__(
        self,
        redlock: Settings,
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
        self._blocking = blocking if blocking is True or blocking is False else flag("blocking", blocking)
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
        self.last_votes: list[Vote] = []
        self.last_attempts = 0  # how many attempts the latest acquire made
        self._failure: tuple[Any, ...] | None = None
        self._last_error: LockNotAcquired | None = None

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

    def _new_token(self) -> str:
        """A token for one attempt: 20 bytes from the operating system's CSPRNG (what the
        secrets module reads too), then the holder text."""
        return os.urandom(20).hex() + self._holder_suffix

    def _grant(self, token: str, started: float, attempts: int, elapsed: float) -> float:
        """Take in an attempt with ``token`` that a quorum granted in a round begun at
        ``started`` (on :func:`.clock.now`): the validity left now. Zero or less: it ran out
        before now, nothing is taken in, and the caller retracts it as a failed attempt whose
        figures say so (that validity, not the round's)."""
        # Anchored before the round, never when its result is looked at: a holder stalled in
        # between (a long GC, a SIGSTOP) must not come back believing it holds what the
        # masters already let expire. So True here implies owned(). One more clock read
        # (81 ns, no system call).
        valid_until = started + self.ttl - self.redlock.drift(self.ttl)
        validity = valid_until - now()
        if validity <= 0:
            return validity
        self._token = token
        self._owner = pid()
        self._valid_until = valid_until
        self._lost_reason = ""
        self._failure = self._last_error = None
        self.last_attempts = attempts
        logger.debug("acquired %s in %.2f ms (validity %.3f s)", self.key, elapsed * 1000, validity)
        return validity

    def _failed(self, votes: list[Vote], attempts: int, elapsed: float, validity: float) -> None:
        """Take in a failed attempt: its figures, for :attr:`last_error`."""
        # Built only when asked for: a contended loop fails far more often than it looks.
        self._failure = (votes, attempts, elapsed, validity)
        self.last_attempts = attempts
        self._last_error = None

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
