"""Reentrant locks: the owner that holds one may acquire it again without blocking.

``Redlock.lock(name, reentrant=True)`` returns a :class:`ReentrantLock`, a *view*: it holds no
token of its own. Each owner (see :mod:`.owner`: the thread, the asyncio task, or one Celery task
execution) that acquires it gets a *holding*: an inner :class:`~.redlock.Lock` sending the
reentrant scripts (the key is a hash {token: count}, see :mod:`.scripts`), and a depth.

- First acquisition by an owner: a plain Redlock acquisition with ``R_ACQUIRE`` in place of
  ``SET NX PX``: the same votes, quorum, validity and retraction.
- Re-entry: one ``R_ENTER`` round, settled exactly as an extension is
  (``Lock._settle_extension``): a quorum renews the validity from the round's start; a lost
  quorum raises :class:`LockLost`; a partial answer keeps the validity the holding has and still
  grants the re-entry, because nobody else can hold a quorum while this owner does.
- Inner exits send ``R_EXIT`` (never deletes) without waiting; the final exit sends
  ``R_RELEASE``, which deletes by token whatever the counts, so a count that drifted on one
  master can neither free the lock early nor keep it after the last exit.

INVARIANT: a lock is held for an owner iff its holding's inner Lock is owned; the depth is the
number of acquisitions minus releases by that owner, kept on the client; the masters' counts only
mirror it. Mutual exclusion comes only from the inner Lock's quorum, as for plain locks.

The registry of holdings is module-level, keyed by (the masters' names, the key, the owner), so
a Redlock rebuilt over the same masters (``app_redlock`` after a settings change) still finds the
owner's holding instead of waiting on itself. A forked child starts with no holdings: it is
another owner, and waits for its parent's release like any contender.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from .._fork import on_fork_in_child
from ..errors import LockLost, LockNotAcquired, Vote
from .clock import now
from .commands import ENTER, EXIT, REENTRANT, milliseconds
from .owner import current_owner
from .resource import Lock, check_wait, raise_on_kind
from .rounds import Call, Rules, Steps, drive
from .tally import is_positive

if TYPE_CHECKING:
    from .redlock import Redlock


class _Inner(Lock):
    """One owner's acquisition of a reentrant lock: a Lock sending the reentrant scripts."""

    _commands = REENTRANT
    _waiting_commands = REENTRANT  # R_ACQUIRE answers a held key with its PTTL already


@dataclass
class _Holding:
    inner: _Inner
    depth: int


_registry: dict[tuple[tuple[str, ...], str, str], _Holding] = {}
_registry_mutex = threading.Lock()


def _forget_after_fork() -> None:
    global _registry_mutex
    _registry.clear()  # the parent's holdings are the parent's
    _registry_mutex = threading.Lock()


on_fork_in_child(_forget_after_fork)


class ReentrantLock:
    """A lock its owner may acquire again while holding it; released when every acquisition of
    that owner has been released. Made by ``Redlock.lock(name, reentrant=True)``.

    The owner is the execution context: the same thread (or, inside a running asyncio task, the
    same task; or one Celery task execution) re-enters. Another thread, another task (even one
    created inside the block, or run with ``asyncio.to_thread``), and another process (a forked
    child too) do not, even through this same object: they contend like anyone else. ``owned()``,
    ``validity``, ``token`` and ``depth`` answer for the asking owner.
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
        # A template Lock checks the arguments now, where they were written.
        self._template = _Inner(redlock, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        self.redlock = redlock
        self.name = name
        self.key = self._template.key
        self.ttl = self._template.ttl
        self._where = tuple(master.name for master in redlock.masters)
        self._holder = holder
        self._last_error: LockNotAcquired | None = None

    def __repr__(self) -> str:
        return f"<ReentrantLock {self.name!r} ttl={self.ttl}s depth={self.depth}>"

    def _id(self) -> tuple[tuple[str, ...], str, str]:
        return (self._where, self.key, current_owner())

    def holding(self) -> Lock | None:
        """The asking owner's inner Lock (what a heartbeat keeps alive), or None."""
        with _registry_mutex:
            found = _registry.get(self._id())
        return found.inner if found is not None else None

    @property
    def depth(self) -> int:
        with _registry_mutex:
            found = _registry.get(self._id())
        return found.depth if found is not None else 0

    @property
    def token(self) -> str | None:
        inner = self.holding()
        return inner.token if inner is not None else None

    @property
    def validity(self) -> float:
        inner = self.holding()
        return inner.validity if inner is not None else 0.0

    def owned(self) -> bool:
        return self.validity > 0.0

    @property
    def last_error(self) -> LockNotAcquired | None:
        return self._last_error

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> bool:
        """Acquire for the asking owner, or enter again if it holds the lock already (then
        without blocking: one round). :class:`LockLost` if it held the lock and lost it; an
        unacquired lock waits as :meth:`Lock.acquire` does."""
        check_wait(blocking, timeout)  # a re-entry does not wait, but takes no bad argument either
        ident = self._id()
        with _registry_mutex:
            found = _registry.get(ident)
        if found is None:
            inner = _Inner(self.redlock, self.name, self.ttl, holder=self._holder)
            if not inner.acquire(blocking, timeout, cancelled=cancelled):
                self._last_error = inner.last_error
                return False
            with _registry_mutex:
                _registry[ident] = _Holding(inner, 1)
            self._last_error = None
            return True
        self._enter(found)
        return True

    def _enter(self, found: _Holding) -> None:
        """One R_ENTER round for an owner that holds the lock (see the module docstring)."""
        inner = found.inner
        redlock = self.redlock
        with inner._mutex():
            token = inner._extendable()
            if token is None:
                raise LockLost(self.name, inner.lost_reason or "validity ran out before the re-entry")
            steps = enter(redlock, self.key, token, inner.ttl)
            first = next(steps)  # its clock starts here, before the round's connects
            with redlock._round() as rnd:
                validity, votes, started = drive(steps, rnd, first)
            raise_on_kind(self.name, votes)
            inner._settle_extension(token, started, inner.ttl, validity, votes)
            if inner.lost_reason or not inner.owned():
                raise LockLost(self.name, inner.lost_reason or "validity ran out during the re-entry")
            found.depth += 1

    def release(self) -> bool:
        """Undo the asking owner's latest acquisition; the last one frees the lock, waiting for
        the replies as :meth:`Lock.release` does (and answering as it does). Does nothing for an
        owner that holds nothing."""
        ident = self._id()
        with _registry_mutex:
            found = _registry.get(ident)
            if found is None:
                return True
            found.depth -= 1
            last = found.depth <= 0
            if last:
                del _registry[ident]
        inner = found.inner
        if last:
            return inner.release()
        token = inner.token
        if token is not None:
            # An inner exit frees nothing, so nobody waits on it: the mirror count on the masters
            # drops by one, its reply read by the link's next use.
            with self.redlock._round() as rnd:
                rnd.send(
                    [EXIT.pack(self.key, token)] * len(self.redlock.masters), self.redlock.request_timeout
                )
        return True

    def extend(self, ttl: float | None = None) -> bool:
        inner = self.holding()
        return inner.extend(ttl) if inner is not None else False

    def ensure(self) -> None:
        inner = self.holding()
        if inner is None:
            raise LockLost(self.name, "not acquired by this owner")
        inner.ensure()

    def __enter__(self) -> ReentrantLock:
        t = self._template
        if not self.acquire(t._blocking, t._timeout):
            assert self.last_error is not None
            raise self.last_error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def enter(redlock: Rules, key: str, token: str, ttl: float) -> Steps[tuple[float, list[Vote], float]]:
    """One re-entry's round (R_ENTER): (validity, votes, started), settled by the caller as an
    extension is (``Lock._settle_extension``, counted from ``started``)."""
    command = ENTER.pack(key, token, milliseconds(ttl))
    started = now()
    outcomes = yield Call([command] * len(redlock.tally.names), redlock.request_timeout)
    elapsed = now() - started
    votes, yes = redlock.tally.votes(outcomes, is_positive)  # the new depth on a master
    validity = ttl - elapsed - redlock.drift(ttl) if yes >= redlock.quorum else 0.0
    return validity, votes, started


def forget_holding(inner: Lock) -> None:
    """Drop the registry's entry for the holding whose inner lock is ``inner``, whoever asks
    (Celery ends an execution's holding from its own hooks). The lock itself is left as it is:
    the caller releases ``inner``, or lets it expire."""
    with _registry_mutex:
        for ident, found in list(_registry.items()):
            if found.inner is inner:
                del _registry[ident]
