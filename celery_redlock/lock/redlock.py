"""The Redlock algorithm over N independent masters. Knows nothing of Celery.

Acquire, as the Redis documentation describes it:

1. note the time, t_start (:func:`.clock.now`, before anything of the round is done, connects
   included);
2. try to set the key to a fresh random token with the TTL on every master at once;
3. the lock is held iff a majority (N//2 + 1) granted it and the validity left,
   ``ttl - (t_end - t_start) - (ttl * drift_factor + 2 ms)``, is positive;
4. otherwise release on every master (also those that did not answer: the write may have
   landed) and try again after a random delay.

The holder may only act on the resource while the validity lasts; :meth:`Lock.extend` renews it
on a quorum, and cannot revive a key that expired or that another token holds.

A lock belongs to the process that acquired it. A forked child's copy of a held :class:`Lock`
is not owned there, and nothing the child does with it reaches the masters; the child may
acquire it anew, as a contender of its own.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Literal, overload

from .._fork import on_fork_in_child, pid
from ..errors import Vote
from . import rounds
from .clock import now
from .commands import PLAIN, Commands, milliseconds
from .fair import FairLock
from .fencing import FencedLock
from .holder import holder_of, holder_read
from .reentrant import ReentrantLock
from .resource import Lock, lock_key
from .rounds import drive
from .settings import CLOCK_DRIFT_FLOOR, MAX_TTL, RedlockWarning, Settings, _min_ttl, lock_kind
from .subscriber import Subscriber
from .transport.commands import Command, Outcome
from .transport.fast import FastTransport
from .transport.interface import Exchange, Transport
from .transport.master import Master

logger = logging.getLogger("celery_redlock.redlock")

# What carries the commands (see lock/transport/interface.py): the default, and the plain
# redis-py one the contract tests run beside it.
TRANSPORTS = ("fast", "redis-py")
# Defined in settings.py (shared with AsyncRedlock); importable from here as they always were.
__all__ = ["CLOCK_DRIFT_FLOOR", "MAX_TTL", "TRANSPORTS", "Redlock", "RedlockWarning", "_min_ttl"]


class Redlock(Settings):
    """A lock factory over N independent Redis masters.

    ``masters`` are redis URLs (``redis://``, ``rediss://``, ``unix://``) or ``redis.Redis``
    clients; only their connection options are used, on connections of our own with
    ``request_timeout`` for connect and read and no client-side retries.

    ``wait``: how ``Lock.acquire(timeout=...)`` waits for a held lock. ``"release"`` (the
    default): it sleeps until the holder's release is published by the masters (one listening
    connection per master per Redlock, made at the first wait; see
    :mod:`celery_redlock.lock.subscriber`), trying again at least every ``wait_poll`` seconds
    (by default ``max(0.5, request_timeout)``, jittered down to half of it) in case a message
    was lost. ``"poll"``: it tries again after a random delay in ``[0, retry_delay)``, for
    servers that refuse SUBSCRIBE.

    ``release_linger`` is accepted for compatibility and has no effect: a release now waits for
    the masters' replies (see :meth:`Lock.release`), and a release that waited for company would
    let a contender that starts after it was called find the lock still held.

    ``transport``: what carries the commands to the masters. ``"fast"`` (the default) drives
    its own non-blocking connections; ``"redis-py"`` uses redis-py connection pools and a thread
    per master, with the same guarantees (bounded rounds, per-master order, releases never lost)
    at a higher cost per round; see :mod:`celery_redlock.lock.transport`.

    A TTL (here, in :meth:`lock` or in :meth:`Lock.extend`) below :attr:`min_ttl`,
    ``(2 ms + request_timeout) / (1 - drift_factor)``, is a :class:`ConfigError`: no round could
    be relied on to leave any validity; so is one above :data:`MAX_TTL`, which no server takes.
    """

    TRANSPORTS = TRANSPORTS

    def _open(self) -> None:
        self.transport: Transport = _transport(self.transport_kind, self.masters)
        # Every operation's exchange with the masters; bound once (the hot path's one lookup).
        self._round: Callable[[], Exchange] = self.transport.round
        on_fork_in_child(self.transport.after_fork_in_child)
        # The waiters' listening links; nothing is connected, and no thread runs, until a wait.
        self._subscriber = Subscriber(self.masters, self.request_timeout)
        # Nothing this Redlock starts may outlive it: a Redlock dropped without close() is closed
        # when it is collected, and every idle link is closed.
        self._finalizer = weakref.finalize(
            self, _close_quietly, self.masters, self.transport, self._subscriber
        )
        self._finalizer.atexit = False  # at exit the sockets close with the process

    def __repr__(self) -> str:
        return f"<Redlock {len(self.masters)} masters quorum={self.quorum} ttl={self.ttl}s>"

    # -- public factory --------------------------------------------------------------------------
    @overload
    def lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
        reentrant: Literal[False] = False,
        fair: bool = False,
        fenced: bool = False,
    ) -> Lock: ...

    @overload
    def lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
        reentrant: Literal[True],
        fair: Literal[False] = False,
        fenced: Literal[False] = False,
    ) -> ReentrantLock: ...

    def lock(
        self,
        name: str,
        ttl: float | None = None,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
        reentrant: bool = False,
        fair: bool = False,
        fenced: bool = False,
    ) -> Lock | ReentrantLock:
        """A :class:`Lock` for one resource. Nothing is sent until it is acquired.

        ``holder``: who takes it (any text without line breaks), stored beside the token so a
        contender or an operator can ask :meth:`holder` who has the resource.

        ``reentrant=True``: a :class:`~celery_redlock.lock.reentrant.ReentrantLock`, which the
        execution context holding it (its thread, asyncio task or Celery task execution) may
        acquire again without blocking. A name is used reentrant everywhere or nowhere: the
        masters hold the two kinds in different forms (:class:`LockKindMismatch` otherwise).

        ``fair=True``: a :class:`~celery_redlock.lock.fair.FairLock`, whose waiters queue on the
        masters and take the lock in arrival order, each woken alone by the release before it.
        Not combined with ``reentrant``.

        ``fenced=True``: a :class:`~celery_redlock.lock.fencing.FencedLock`, whose every grant
        carries ``lock.fence``, an int above the fence of every earlier grant of the name, for the
        resource to refuse a paused holder's late write (:mod:`celery_redlock.fenced`). Costs a
        second round per grant. Not combined with ``reentrant`` or ``fair``.
        """
        if reentrant is False and fair is False and fenced is False:  # the usual call: no checks
            return Lock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        kind = lock_kind(reentrant=reentrant, fair=fair, fenced=fenced)
        if kind == "fenced":
            return FencedLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        if kind == "fair":
            return FairLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        if kind == "reentrant":
            return ReentrantLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        return Lock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)

    def close(self) -> None:
        """Close every idle connection, and the waiters' listening ones.

        Safe to call again; the Redlock stays usable (a later operation reconnects).
        """
        _close(self.masters, self.transport, self._subscriber)

    def __enter__(self) -> Redlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the algorithm ----------------------------------------------------------------------------
    def try_acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        commands: Commands = PLAIN,
        expiry: list[float] | None = None,
        *,
        acquires: Sequence[Command] | None = None,
        retraction: Command | None = None,
        seen: list[Outcome] | None = None,
        undo: Command | None = None,
        tidy: Command | None = None,
    ) -> tuple[float, list[Vote], float]:
        """One attempt. Returns (validity, votes, elapsed); validity > 0 means acquired.

        On failure every master is sent the release on the link the acquire used, so a late
        write is always followed by its deletion. ``expiry``, if given (with commands whose
        refusals answer the key's PTTL, first if a list), receives when a quorum could be free
        at the earliest.

        A kind of lock that sends more than (key, token, ttl) packs its own commands: one per
        master in ``acquires`` and the ``retraction`` of a failed attempt; ``seen`` receives
        every master's outcome (fair.py reads its queue from them). A kind whose grant replaced
        a value that a failed attempt must put back sends ``undo`` to a failed attempt's masters
        instead (markers.HandoverLock); the late masters of a granted attempt are still sent the
        ``retraction``, unless the kind gives a ``tidy``: then every master that did not grant a
        granted attempt is sent that (it must retract a late grant as well).
        """
        # rounds.attempt's two steps, run here without its generator (the hot path of every
        # lock). Its clock starts before the round takes or makes any link.
        t_start = now()
        if acquires is None:
            acquires = rounds.acquiring(self, key, token, ttl, commands)
        with self._round() as rnd:
            outcomes = rnd.call(acquires, self.request_timeout)
            result, follow = rounds.counted(
                self, outcomes, t_start, key, token, ttl, commands, expiry, seen, retraction, undo, tidy
            )
            if follow is not None:
                rnd.send(follow, self.request_timeout)
        return result

    def try_extend(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> tuple[float, list[Vote], float]:
        """Reset the TTL on every master that still holds ``token``; (validity, votes, elapsed)."""
        steps = rounds.extend(self, key, token, ttl, commands)
        first = next(steps)  # before the round's connects, as in try_acquire
        with self._round() as rnd:
            return drive(steps, rnd, first)

    def _extension(
        self, outcomes: Sequence[Outcome], ttl: float, elapsed: float
    ) -> tuple[float, list[Vote], float]:
        """An extension's (validity, votes, elapsed) from every master's outcome of it."""
        return rounds.extension(self, outcomes, ttl, elapsed)

    def extend_many(self, locks: Sequence[Lock]) -> list[bool]:
        """Extend each of ``locks`` to its own TTL, all in one round; ``[k]`` is what
        ``locks[k].extend()`` would have returned.

        Every extension for a master goes out in one write and the replies are read in order
        (:meth:`Round.call_many`), so n locks cost one round trip, not n: what lets one process
        keep many locks alive behind a slow master. Each lock takes in its result by the same
        rules as :meth:`Lock.extend` (``Lock._settle_extension``), counted from the one start
        of the round.
        """
        first: dict[int, Lock] = {}  # a lock listed twice is extended once
        for lock in locks:
            if lock.redlock is not self:
                raise ValueError(f"lock {lock.name!r} belongs to another Redlock")
            first.setdefault(id(lock), lock)
        me = pid()
        extended: dict[int, bool] = {}
        with contextlib.ExitStack() as holding:
            # Each lock's mutex is held across the round, as extend() holds it. They are taken
            # in one order (by id), so two callers sharing locks cannot deadlock each other. A
            # forked child's copy of its parent's lock is never extended (see Lock.extend).
            batch: list[tuple[Lock, str]] = []
            for key in sorted(first):
                lock = first[key]
                if lock._owner != me:
                    continue
                holding.enter_context(lock._mutex())
                token = lock._extendable()
                if token is not None:
                    batch.append((lock, token))
            if batch:
                commands = [
                    lock._commands.extend.pack(lock.key, token, milliseconds(lock.ttl))
                    for lock, token in batch
                ]
                started = now()  # before the round's connects, as in try_extend
                with self._round() as rnd:
                    replies = rnd.call_many([commands] * len(self.masters), self.request_timeout)
                    elapsed = now() - started
                for j, (lock, token) in enumerate(batch):
                    validity, votes, _ = self._extension([mine[j] for mine in replies], lock.ttl, elapsed)
                    extended[id(lock)] = lock._settle_extension(token, started, lock.ttl, validity, votes)
        # Outside the mutexes, as extend() does: the hook may do a round of its own.
        for lock in first.values():
            if extended.get(id(lock)):
                lock.extended(lock.ttl)
        return [extended.get(id(lock), False) for lock in locks]

    def release_key(
        self,
        key: str,
        token: str,
        *,
        commands: Commands = PLAIN,
        command: Command | None = None,
        lock: Lock | None = None,
    ) -> bool:
        """Compare-and-delete ``key`` for ``token`` on every master, and wait for the replies
        (within ``request_timeout``); True when a quorum answered, so that the lock is no longer
        ours on a quorum. ``command``, if given, is sent instead of ``commands``' release (a fair
        lock's). When no quorum answered, ``lock`` (the Lock released, if any) is given every
        master's vote in its ``release_votes``, so that whoever warns can name the masters.

        INVARIANT (release-then-acquire): when this returns True, an acquire that any client
        starts afterwards finds no key of ``token`` on a quorum, so it is not refused by this lock.
        A master that answers 0 no longer had the key (expired, or another token's): that is a
        release that took effect there too. False means fewer than a quorum answered; the TTL
        still bounds the lock.
        """
        if command is None:
            command = commands.release.pack(key, token)
        with self._round() as rnd:
            votes = drive(rounds.release(self, command), rnd)
        if votes is None:
            return True
        if lock is not None:
            lock.release_votes = votes
        return False

    def send_release(
        self,
        key: str,
        token: str,
        *,
        commands: Commands = PLAIN,
        command: Command | None = None,
    ) -> None:
        """:meth:`release_key` without waiting for the replies: each master applies it as it
        arrives, and the connection's next use reads the acknowledgement. For a retraction and
        for :meth:`Lock.release_without_waiting`, never for a release someone may observe."""
        if command is None:
            command = commands.release.pack(key, token)
        with self._round() as rnd:
            drive(rounds.send_release(self, command), rnd)

    def write_everywhere(self, key: str, value: str, ttl: float) -> int:
        """SET a plain (non-lock) key on every master with a TTL; returns how many accepted it.

        For records that sit beside a lock (e.g. who leads a beat cluster), never for the lock.
        """
        outcomes = self._everywhere(("SET", key, value, "PX", max(1, int(ttl * 1000))))
        return sum(1 for o in outcomes if o.kind == "ok")

    def read_everywhere(self, key: str) -> list[bytes | None]:
        """GET a plain key from every master (None where absent, or where a master failed)."""
        return [o.value if o.kind == "ok" else None for o in self._everywhere(("GET", key))]

    def holder(self, name: str) -> str | None:
        """The ``holder`` text of the lock a quorum of masters holds on resource ``name`` ("" if
        it was taken without one), or None when no quorum holds one token (free, expiring, or
        not answering). One round; asked by a contender, never on the way to a lock."""
        return holder_of(self._everywhere(holder_read(lock_key(self.key_prefix, name))), self.quorum)

    def holders(self, key: str) -> int:
        """How many masters hold ``key`` at all (by any token)."""
        return sum(1 for o in self._everywhere(("EXISTS", key)) if o.kind == "ok" and o.value == 1)

    def _everywhere(self, command: Command) -> list[Outcome]:
        """``command`` sent to every master in one round, each outcome by ``request_timeout``."""
        with self._round() as rnd:
            return rnd.call([command] * len(self.masters), self.request_timeout)


def _transport(name: str, masters: Sequence[Master]) -> Transport:
    if name == "redis-py":
        from .transport.reference import ReferenceTransport

        return ReferenceTransport(masters)
    return FastTransport(masters)


def _close(masters: Sequence[Master], transport: Transport, subscriber: Subscriber) -> None:
    subscriber.close()
    for master in masters:  # their idle links (the fast transport's rounds use them too)
        master.close()
    transport.close()


def _close_quietly(masters: Sequence[Master], transport: Transport, subscriber: Subscriber) -> None:
    """:func:`_close` for a Redlock being collected: nobody is there to hear of a failure."""
    try:
        _close(masters, transport, subscriber)
    except Exception:
        logger.warning("closing a dropped Redlock failed", exc_info=True)
