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
import functools
import hashlib
import logging
import math
import os
import random
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from .._fork import on_fork_in_child, pid
from .._validate import choice, count, number, wait_timeout
from ..errors import ConfigError, LockLost, LockNotAcquired, RedlockError, Vote
from . import scripts, wire
from .clock import now
from .linger import Lingering
from .masters import (
    GRANTED,
    HELD,
    Command,
    LinkSet,
    Master,
    Outcome,
    Round,
    refuse_shared_servers,
    script_template,
)
from .subscriber import Subscriber, Waiter

if TYPE_CHECKING:
    from .reentrant import ReentrantLock

logger = logging.getLogger("celery_redlock.redlock")

# Names longer than this are shortened to a readable head plus a digest of the whole name.
MAX_NAME_LENGTH = 512
# The least drift allowed for, whatever the TTL: clock granularity and the scheduling delay
# between a master setting the key and its reply being read.
CLOCK_DRIFT_FLOOR = 0.002
MAX_RELEASE_LINGER = 1.0

# The commands, packed from templates: only key, token and TTL are encoded per call.
ACQUIRE = wire.Template(("SET", wire.SLOT, wire.SLOT, "NX", "PX", wire.SLOT))  # key token <ms>
RELEASE = script_template(scripts.RELEASE, 1, 1)  # key token
EXTEND = script_template(scripts.EXTEND, 1, 2)  # key token <ms>


@dataclass(frozen=True)
class Commands:
    """The three commands one kind of lock is taken, released and extended with, packed from
    (key, token[, ttl ms]). A grant answers ``+OK``; a release or extension answers 1 if the
    token held the key."""

    acquire: wire.Template
    release: wire.Template
    extend: wire.Template


PLAIN = Commands(ACQUIRE, RELEASE, EXTEND)
# A waiting plain lock's later attempts: refusals carry the holder's remaining TTL.
PLAIN_WAITING = Commands(script_template(scripts.ACQUIRE_WAIT, 1, 2), RELEASE, EXTEND)
# A reentrant lock's key is a hash {token: count} (see scripts.py and reentrant.py).
REENTRANT = Commands(
    script_template(scripts.R_ACQUIRE, 1, 2),
    script_template(scripts.R_RELEASE, 1, 1),
    script_template(scripts.R_EXTEND, 1, 2),
)


class RedlockWarning(UserWarning):
    """A configuration that works but weakens the lock's guarantees."""


# Between a token's random part and the holder text stored with it (see Redlock.lock).
HOLDER_SEPARATOR = "|"


def lock_key(prefix: str, name: object) -> str:
    """The key a resource name is stored under; over-long names keep a head and a digest."""
    if not isinstance(name, str):
        raise ConfigError(f"lock name must be a str, got {type(name).__name__}: {name!r}")
    if not name:
        raise ConfigError("lock name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        name = f"{name[:64]}~sha256:{digest}"
    return prefix + name


class Redlock:
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

    ``release_linger`` (seconds, 0 by default) lets a release wait that long at most to travel
    with this process's next round to the masters instead of in one of its own (see
    :mod:`celery_redlock.lock.linger`); ``Lock.release(linger=False)`` still sends at once.

    A TTL (here, in :meth:`lock` or in :meth:`Lock.extend`) below :attr:`min_ttl`,
    ``(2 ms + request_timeout) / (1 - drift_factor)``, is a :class:`ConfigError`: no round could
    be relied on to leave any validity.
    """

    def __init__(
        self,
        masters: Iterable[str | Any],
        *,
        ttl: float = 30.0,
        retry_count: int = 3,
        retry_delay: float = 0.2,
        drift_factor: float = 0.01,
        request_timeout: float = 0.1,
        key_prefix: str = "redlock:",
        release_linger: float = 0.0,
        wait: str = "release",
        wait_poll: float | None = None,
    ) -> None:
        if isinstance(masters, (str, bytes)):
            masters = [masters]
        specs = list(masters)
        if not specs:
            raise ConfigError("masters: at least one master is needed")
        ttl = number("ttl", ttl, above=0, unit="seconds")
        self.retry_count = count("retry_count", retry_count)
        self.retry_delay = number("retry_delay", retry_delay, at_least=0, unit="seconds")
        self.drift_factor = number("drift_factor", drift_factor, at_least=0, below=0.5)
        self.request_timeout = number("request_timeout", request_timeout, above=0, unit="seconds")
        self.min_ttl = _min_ttl(self.request_timeout, self.drift_factor)
        self.ttl = self.check_ttl("ttl", ttl)
        if not isinstance(key_prefix, str):
            raise ConfigError(f"key_prefix must be a str, got {key_prefix!r}")
        self.key_prefix = key_prefix
        self.release_linger = number(
            "release_linger",
            release_linger,
            at_least=0,
            at_most=MAX_RELEASE_LINGER,
            unit="seconds",
            why="it delays every release by up to that much",
        )

        self.wait = choice("wait", wait, ("release", "poll"))
        self.wait_poll = number(
            "wait_poll",
            max(0.5, self.request_timeout) if wait_poll is None else wait_poll,
            at_least=self.request_timeout,
            unit="seconds",
            why="at least request_timeout: a fallback try must have time to finish",
        )

        self.masters: list[Master] = [Master.from_spec(s, self.request_timeout) for s in specs]
        refuse_shared_servers(self.masters)
        if len(self.masters) % 2 == 0:
            message = (
                f"masters: {len(self.masters)} is even; a quorum of {len(self.masters) // 2 + 1} "
                f"tolerates no more failures than {len(self.masters) - 1} masters would"
            )
            warnings.warn(message, RedlockWarning, stacklevel=2)
            logger.warning(message)
        self.quorum = len(self.masters) // 2 + 1
        # Votes are immutable; the two answers a healthy master gives are shared, not rebuilt.
        self._granted_votes = [Vote(m.name, "yes") for m in self.masters]
        self._refused_votes = [Vote(m.name, "held") for m in self.masters]
        # Nothing this Redlock starts may outlive it. The linger ticker is given the masters, not
        # the Redlock (a bound method would keep the Redlock alive for as long as the thread
        # runs), and a Redlock dropped without close() is closed when it is collected: its
        # lingering releases are sent, the ticker stops, every idle link is closed.
        # Whole sets of idle links, one per master, that rounds leave and take (see LinkSet).
        self._sets: list[LinkSet] = []
        on_fork_in_child(self._after_fork_in_child)
        self._lingering = (
            Lingering(
                self.release_linger, functools.partial(_send, self.masters, self._sets, self.request_timeout)
            )
            if self.release_linger
            else None
        )
        # The waiters' listening links; nothing is connected, and no thread runs, until a wait.
        self._subscriber = Subscriber(self.masters, self.request_timeout)
        self._finalizer = weakref.finalize(
            self, _close_quietly, self._lingering, self.masters, self._sets, self._subscriber
        )
        self._finalizer.atexit = False  # at exit, linger's own hook sends what still lingers

    def __repr__(self) -> str:
        return f"<Redlock {len(self.masters)} masters quorum={self.quorum} ttl={self.ttl}s>"

    def _after_fork_in_child(self) -> None:
        # The parent's parked links are the parent's: dropped unused, as Master drops its idle
        # stacks, which closes only the child's copies of their sockets. Emptied in place: the
        # linger sender holds the same list.
        self._sets.clear()

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
    ) -> Lock | ReentrantLock:
        """A :class:`Lock` for one resource. Nothing is sent until it is acquired.

        ``holder``: who takes it (any text without line breaks), stored beside the token so a
        contender or an operator can ask :meth:`holder` who has the resource.

        ``reentrant=True``: a :class:`~celery_redlock.lock.reentrant.ReentrantLock`, which the
        execution context holding it (its thread, asyncio task or Celery task execution) may
        acquire again without blocking. A name is used reentrant everywhere or nowhere: the
        masters hold the two kinds in different forms (:class:`LockKindMismatch` otherwise).
        """
        if reentrant is True:
            from .reentrant import ReentrantLock

            return ReentrantLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        if reentrant is not False:
            raise ConfigError(f"reentrant must be True or False, got {reentrant!r}")
        return Lock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)

    def flush_releases(self) -> None:
        """Send every lingering release now (see ``release_linger``)."""
        if self._lingering is not None:
            self._lingering.flush()

    def close(self) -> None:
        """Send any lingering releases, then close every idle connection.

        Safe to call again; the Redlock stays usable (a later operation reconnects).
        """
        _close(self._lingering, self.masters, self._sets, self._subscriber)

    def __enter__(self) -> Redlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the algorithm ----------------------------------------------------------------------------
    def drift(self, ttl: float) -> float:
        return ttl * self.drift_factor + CLOCK_DRIFT_FLOOR

    def check_ttl(self, name: str, value: object) -> float:
        """``value`` as a TTL this Redlock can honour (at least :attr:`min_ttl`), else a
        :class:`ConfigError` that names the minimum and what it follows from."""
        ttl = number(name, value, above=0, unit="seconds")
        if ttl < self.min_ttl:
            raise ConfigError(
                f"{name} must be at least {self.min_ttl:g} seconds, got {value!r}: a round may take up "
                f"to request_timeout ({self.request_timeout:g} s) and the drift allowance is "
                f"ttl * drift_factor ({self.drift_factor:g}) + {CLOCK_DRIFT_FLOOR * 1000:g} ms, so a "
                "shorter TTL could be granted by every master and still leave no validity"
            )
        return ttl

    def _round(self) -> Round:
        # Lingering releases ride along with whatever this round sends first.
        lingering = self._lingering
        return Round(self.masters, lingering.take() if lingering is not None else (), self._sets)

    def _votes(self, outcomes: Sequence[Outcome], granted: object = 1) -> tuple[list[Vote], int]:
        """One vote per master: ``yes`` where the reply equals ``granted``, ``held`` where it
        does not (the key is someone else's, or gone), else the error or timeout; and how many
        said yes."""
        votes = []
        yes = 0
        for i, outcome in enumerate(outcomes):
            if outcome.kind == "ok":
                if outcome.value == granted:
                    votes.append(self._granted_votes[i])
                    yes += 1
                else:
                    votes.append(self._refused_votes[i])
            else:
                votes.append(Vote(self.masters[i].name, outcome.kind, outcome.detail))
        return votes, yes

    def try_acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        commands: Commands = PLAIN,
        expiry: list[float] | None = None,
    ) -> tuple[float, list[Vote], float]:
        """One attempt. Returns (validity, votes, elapsed); validity > 0 means acquired.

        On failure every master is sent the release on the link the acquire used, so a late
        write is always followed by its deletion. ``expiry``, if given (with commands whose
        refusals answer the key's PTTL), receives when a quorum could be free at the earliest.
        """
        acquire = commands.acquire.pack(key, token, _milliseconds(ttl))
        # Taken before the round makes any missing connection: all of the round, connects
        # included, is spent out of the TTL (and Lock counts its validity from earlier still).
        t_start = now()
        with self._round() as rnd:
            outcomes = rnd.call([acquire] * len(self.masters), self.request_timeout)
            elapsed = now() - t_start
            if outcomes.count(GRANTED) == len(outcomes):  # the usual rounds: compared by identity
                votes, granted = list(self._granted_votes), len(outcomes)
            elif outcomes.count(HELD) == len(outcomes):
                votes, granted = list(self._refused_votes), 0
            else:
                votes, granted = self._votes(outcomes, granted=b"OK")
            validity = ttl - elapsed - self.drift(ttl)
            if expiry is not None:
                expiry.append(self._free_at(outcomes, t_start + elapsed))
            if granted >= self.quorum and validity > 0:
                if granted < len(votes):
                    # A master that answered late may still set the key; retract it on the same
                    # link (not waited for) so the key cannot outlive our release.
                    release = commands.release.pack(key, token)
                    late = [release if v.kind == "timeout" else None for v in votes]
                    if any(late):
                        rnd.send(late, self.request_timeout)
                return validity, votes, elapsed
            release = commands.release.pack(key, token)
            # A master that answered "held" refused our SET: nothing of ours is there to delete.
            # Every other one (yes, error, timeout) may hold our token and gets the release.
            retract = [None if v.kind == "held" else release for v in votes]
            if any(retract):
                rnd.send(retract, self.request_timeout)
        return min(validity, 0.0), votes, elapsed

    def _free_at(self, outcomes: Sequence[Outcome], t_end: float) -> float:
        """When a quorum of masters could have let the key expire, at the earliest: a master
        that granted counts as free now (its grant is retracted), one that answered a PTTL
        as free by then (it ran the script before ``t_end``), any other never."""
        remaining = []
        for outcome in outcomes:
            value = outcome.value if outcome.kind == "ok" else None
            if value == b"OK":
                remaining.append(0.0)
            elif isinstance(value, int) and value >= 0:
                remaining.append(value / 1000)
            else:  # an error, a timeout, or a key with no TTL (-1)
                remaining.append(math.inf)
        remaining.sort()
        return t_end + remaining[self.quorum - 1] + 0.001

    def try_extend(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> tuple[float, list[Vote], float]:
        """Reset the TTL on every master that still holds ``token``; (validity, votes, elapsed)."""
        command = commands.extend.pack(key, token, _milliseconds(ttl))
        t_start = now()  # before the round's connects, as in try_acquire
        with self._round() as rnd:
            outcomes = rnd.call([command] * len(self.masters), self.request_timeout)
            elapsed = now() - t_start
        return self._extension(outcomes, ttl, elapsed)

    def _extension(
        self, outcomes: Sequence[Outcome], ttl: float, elapsed: float
    ) -> tuple[float, list[Vote], float]:
        """An extension's (validity, votes, elapsed) from every master's outcome of it."""
        votes, granted = self._votes(outcomes)
        validity = ttl - elapsed - self.drift(ttl)
        return (validity if granted >= self.quorum else 0.0), votes, elapsed

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
                    lock._commands.extend.pack(lock.key, token, _milliseconds(lock.ttl))
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

    def release_key(self, key: str, token: str, *, linger: bool = True, commands: Commands = PLAIN) -> None:
        """Send the compare-and-delete to every master, without waiting for the replies.

        Each master applies it as it arrives, before anything this process sends it later on
        that connection; the acknowledgements are read by the connection's next use. Waiting
        would only tell us what expiry makes true anyway, at the price of a round trip. With
        ``release_linger`` set (and ``linger``), it waits to travel with the next round.
        """
        command = commands.release.pack(key, token)
        if linger and self._lingering is not None:
            self._lingering.add(command)
            return
        with self._round() as rnd:
            rnd.send([command] * len(self.masters), self.request_timeout)

    def write_everywhere(self, key: str, value: str, ttl: float) -> int:
        """SET a plain (non-lock) key on every master with a TTL; returns how many accepted it.

        For records that sit beside a lock (e.g. who leads a beat cluster), never for the lock.
        """
        command = ("SET", key, value, "PX", max(1, int(ttl * 1000)))
        with self._round() as rnd:
            outcomes = rnd.call([command] * len(self.masters), self.request_timeout)
        return sum(1 for o in outcomes if o.kind == "ok")

    def read_everywhere(self, key: str) -> list[bytes | None]:
        """GET a plain key from every master (None where absent, or where a master failed)."""
        with self._round() as rnd:
            outcomes = rnd.call([("GET", key)] * len(self.masters), self.request_timeout)
        return [o.value if o.kind == "ok" else None for o in outcomes]

    def holder(self, name: str) -> str | None:
        """The ``holder`` text of the lock a quorum of masters holds on resource ``name`` ("" if
        it was taken without one), or None when no quorum holds one token (free, expiring, or
        not answering). One round; asked by a contender, never on the way to a lock."""
        values = self.read_everywhere(lock_key(self.key_prefix, name))
        counts: dict[bytes, int] = {}
        for value in values:
            if value is not None:
                counts[value] = counts.get(value, 0) + 1
        for value, held in counts.items():
            if held >= self.quorum:
                _, _, text = value.decode("utf-8", "replace").partition(HOLDER_SEPARATOR)
                return text
        return None

    def holders(self, key: str) -> int:
        """How many masters hold ``key`` at all (by any token)."""
        with self._round() as rnd:
            outcomes = rnd.call([("EXISTS", key)] * len(self.masters), self.request_timeout)
        return sum(1 for o in outcomes if o.kind == "ok" and o.value == 1)


def _min_ttl(request_timeout: float, drift_factor: float) -> float:
    """The least TTL a round can honour, rounded up to the millisecond the masters count in.

    A round counts only the replies that arrive within ``request_timeout``, so a round that
    gathered its quorum in time took less than that. Its validity,
    ``ttl - elapsed - (ttl * drift_factor + CLOCK_DRIFT_FLOOR)``, is then positive for every such
    round iff ``ttl * (1 - drift_factor) >= CLOCK_DRIFT_FLOOR + request_timeout``. Below that,
    every master could grant a lock (or an extension) that is already worth nothing, and the
    holder could not tell a slow round from a lost lock. A round that must first connect takes
    longer still, which is why a TTL should be far above this minimum, not at it.
    """
    raw = (CLOCK_DRIFT_FLOOR + request_timeout) / (1 - drift_factor)
    return math.ceil(raw * 1000 - 1e-9) / 1000


def _milliseconds(ttl: float) -> int:
    """The TTL a master is sent: rounded up, never down, so no master drops a key sooner than
    the validity counted from ``ttl`` assumes."""
    return math.ceil(ttl * 1000)


def _send(
    masters: Sequence[Master], sets: list[LinkSet], timeout: float, commands: Sequence[Command]
) -> None:
    """Send ``commands`` (lingering releases) to every master in a round of their own."""
    with Round(masters, commands, sets) as rnd:
        rnd.send([None] * len(masters), timeout)


def _close(
    lingering: Lingering | None, masters: Sequence[Master], sets: list[LinkSet], subscriber: Subscriber
) -> None:
    if lingering is not None:
        lingering.close()
    subscriber.close()
    for master in masters:
        master.close()
    while sets:
        try:
            linkset = sets.pop()
        except IndexError:
            break  # another thread's round took the last one
        if linkset.pid == pid():  # a parent's sets are the parent's to close
            for link in linkset.links:
                link.close()


def _close_quietly(
    lingering: Lingering | None, masters: Sequence[Master], sets: list[LinkSet], subscriber: Subscriber
) -> None:
    """:func:`_close` for a Redlock being collected: nobody is there to hear of a failure."""
    try:
        _close(lingering, masters, sets, subscriber)
    except Exception:
        logger.warning("closing a dropped Redlock failed", exc_info=True)


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
        self._blocking = blocking
        if not isinstance(holder, str) or "\n" in holder or "\r" in holder:
            raise ConfigError(f"holder must be a str without line breaks, got {holder!r}")
        # Appended to every token of this lock: the token stays unique per acquisition (its
        # random part), and the stored value also says who took it, in the same SET.
        self._holder_suffix = HOLDER_SEPARATOR + holder if holder else ""
        self._token: str | None = None
        self._owner = 0  # the pid of the process that acquired the token (see _fork.pid)
        self._valid_until = 0.0
        self._lost_reason = ""
        self._op = threading.Lock()
        self._op_pid = pid()  # the process _op was made in
        self.last_votes: list[Vote] = []
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
        if timeout is not None:
            if not blocking:
                raise ConfigError("timeout cannot be given with blocking=False")
            timeout = wait_timeout("timeout", timeout)
        if self.owned():
            raise RedlockError(f"lock {self.name!r} is already held by this Lock")
        redlock = self.redlock
        deadline = None if timeout is None else now() + timeout
        attempts = 0
        mutex = self._mutex()
        # Set once this call waits in a room of the Redlock's subscriber (see _wait).
        waiter: Waiter | None = None
        expiry: list[float] = []  # when a waiting attempt found a quorum could be free
        try:
            while True:
                attempts += 1
                if waiter is not None:
                    redlock._subscriber.mark(self.key, waiter)
                # 20 bytes from the operating system's CSPRNG (what the secrets module reads too).
                token = os.urandom(20).hex() + self._holder_suffix
                with mutex:
                    started = now()
                    if waiter is None:
                        validity, votes, elapsed = redlock.try_acquire(
                            self.key, token, self.ttl, self._commands
                        )
                    else:
                        expiry.clear()
                        validity, votes, elapsed = redlock.try_acquire(
                            self.key, token, self.ttl, self._waiting_commands, expiry
                        )
                    self.last_votes = votes
                    if validity > 0:
                        # Anchored before the round, never when its result is looked at: a
                        # holder stalled in between (a long GC, a SIGSTOP) must not come back
                        # believing it holds what the masters already let expire. So True here
                        # implies owned(). One more clock read (81 ns, no system call).
                        valid_until = started + self.ttl - redlock.drift(self.ttl)
                        validity = valid_until - now()
                        if validity > 0:
                            self._token = token
                            self._owner = pid()
                            self._valid_until = valid_until
                            self._lost_reason = ""
                            self._failure = self._last_error = None
                            logger.debug(
                                "acquired %s in %.2f ms (validity %.3f s)", self.key, elapsed * 1000, validity
                            )
                            return True
                        # Granted, but run out before it was looked at: a failed attempt, and so
                        # released like one.
                        redlock.release_key(self.key, token, commands=self._commands)
                self._refused(votes)
                # Built only when asked for: a contended loop fails far more often than it looks.
                self._failure = (votes, attempts, elapsed, validity)
                self._last_error = None
                if not blocking:
                    return False
                if deadline is None:
                    if attempts > redlock.retry_count:
                        return False
                    time.sleep(random.uniform(0, redlock.retry_delay))
                    continue
                if deadline - now() <= 0 or (cancelled is not None and cancelled()):
                    return False
                if redlock.wait == "poll":
                    if not _nap(min(deadline, now() + random.uniform(0, redlock.retry_delay)), cancelled):
                        return False
                elif waiter is None:
                    # The first refusal: join the key's room, then try again at once (the holder
                    # may have released while we subscribed; its notice would predate our mark).
                    waiter = redlock._subscriber.join(
                        self.key, min(deadline, now() + redlock.request_timeout)
                    )
                elif not self._wait(waiter, votes, deadline, expiry[0] if expiry else math.inf, cancelled):
                    return False
        finally:
            if waiter is not None:
                redlock._subscriber.leave(self.key, waiter)

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
        """Called with the votes of each failed attempt; a kind of lock that can tell a refusal
        no retry will change (see reentrant.py) raises here."""

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
        if validity > 0 and self._token == token and limit > now():
            self._valid_until = limit
            return True
        self._valid_until = min(self._valid_until, limit)
        gone = sum(1 for v in votes if v.kind == "held")
        if gone > len(votes) - self.redlock.quorum:
            self._lost_reason = f"{gone} of {len(votes)} masters no longer hold this token"
        logger.debug("extension of %s failed: %s", self.key, "; ".join(map(str, votes)))
        return False

    def release(self, *, linger: bool = True) -> None:
        """Release on every master. Releasing a lock not held (or already gone) does nothing.

        Returns once the release is on its way to every reachable master (see
        :meth:`Redlock.release_key`); it does not wait a round trip for the acknowledgements.
        If the Redlock has a ``release_linger``, the release may wait that long for company;
        ``linger=False`` sends it at once.
        """
        with self._mutex():
            if self._owner != pid():
                # Not acquired, or a forked child's copy of its parent's lock: that lock is the
                # parent's, and nothing of it is sent from here. The copy forgets the token, so
                # it can be acquired anew as the child's own.
                self._token = None
                return
            token, self._token = self._token, None
            self._valid_until = 0.0
            self._lost_reason = ""
        if token is not None:
            self.redlock.release_key(self.key, token, linger=linger, commands=self._commands)

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
