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
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

from .._fork import on_fork_in_child, pid
from .._validate import choice, count, number
from ..errors import ConfigError, Vote
from .clock import now
from .commands import PLAIN, Commands, milliseconds
from .fair import FairLock
from .fencing import FencedLock
from .reentrant import ReentrantLock
from .resource import HOLDER_SEPARATOR, Lock, lock_key
from .subscriber import Subscriber
from .tally import Tally, is_answer, is_ok, is_one, to_late
from .tally import retraction as retraction_of
from .transport.commands import GRANTED, HELD, Command, Outcome
from .transport.fast import FastTransport
from .transport.identity import refuse_shared_servers
from .transport.interface import Exchange, Transport
from .transport.master import Master

logger = logging.getLogger("celery_redlock.redlock")

# The least drift allowed for, whatever the TTL: clock granularity and the scheduling delay
# between a master setting the key and its reply being read.
CLOCK_DRIFT_FLOOR = 0.002
# The longest TTL the servers take (seconds, ~290 million years). ``PX`` and ``PEXPIRE`` take a
# signed 64-bit count of milliseconds, which the server adds to its clock (milliseconds since the
# epoch) and refuses if the sum passes 2**63 - 1 (about 9.2234e18): this leaves room for a clock
# 700,000 years ahead, and is exact as a float and in milliseconds. Above the servers' bound,
# every acquire would fail on every master ("invalid expire time" or "not an integer").
MAX_TTL = 9.2e15
_MAX_TTL_WHY = "the servers count a TTL in milliseconds added to their clock, in 63 bits"
# What carries the commands (see lock/transport/interface.py): the default, and the plain
# redis-py one the contract tests run beside it.
TRANSPORTS = ("fast", "redis-py")


class RedlockWarning(UserWarning):
    """A configuration that works but weakens the lock's guarantees."""


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
        fence_retention: float = 86400.0,
        transport: str = "fast",
    ) -> None:
        if isinstance(masters, (str, bytes)):
            masters = [masters]
        try:
            specs = list(masters)
        except TypeError:
            raise ConfigError(
                f"masters must be a list of redis URLs or redis.Redis clients, got "
                f"{type(masters).__name__} {masters!r}"
            ) from None
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
        if number("release_linger", release_linger, at_least=0, unit="seconds"):
            warnings.warn(
                "release_linger has no effect: a release waits for the masters' replies",
                DeprecationWarning,
                stacklevel=2,
            )

        self.wait = choice("wait", wait, ("release", "poll"))
        self.wait_poll = number(
            "wait_poll",
            max(0.5, self.request_timeout) if wait_poll is None else wait_poll,
            at_least=self.request_timeout,
            unit="seconds",
            why="at least request_timeout: a fallback try must have time to finish",
        )

        # How long a name's fence counter outlives its last fenced grant (see fencing.py): once it
        # has expired, the clock floor is a whole retention past the last fence recorded.
        self.fence_retention = number(
            "fence_retention", fence_retention, above=0, at_most=MAX_TTL, unit="seconds", why=_MAX_TTL_WHY
        )
        if self.fence_retention < 3600:
            message = (
                f"fence_retention {self.fence_retention:g} s is under an hour: a counter that expires "
                "falls back to a master's clock, which may be behind the clock that issued the last fence"
            )
            warnings.warn(message, RedlockWarning, stacklevel=2)

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
        # Outcomes to votes, for every kind of lock (lock/tally.py).
        self.tally = Tally([m.name for m in self.masters])
        self.transport: Transport = _transport(choice("transport", transport, TRANSPORTS), self.masters)
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
        for option, value in (("fair", fair), ("fenced", fenced)):
            if value is not False and value is not True:
                raise ConfigError(f"{option} must be True or False, got {value!r}")
        if fenced:
            if reentrant is not False or fair:
                raise ConfigError("fenced=True cannot be combined with reentrant=True or fair=True")
            return FencedLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        if fair:
            if reentrant is not False:
                raise ConfigError("fair=True cannot be combined with reentrant=True")
            return FairLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        if reentrant is True:
            return ReentrantLock(self, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        if reentrant is not False:
            raise ConfigError(f"reentrant must be True or False, got {reentrant!r}")
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
    def drift(self, ttl: float) -> float:
        return ttl * self.drift_factor + CLOCK_DRIFT_FLOOR

    def check_ttl(self, name: str, value: object) -> float:
        """``value`` as a TTL this Redlock can honour (at least :attr:`min_ttl`, at most
        :data:`MAX_TTL`), else a :class:`ConfigError` that names the bound and what it follows from."""
        ttl = number(name, value, above=0, at_most=MAX_TTL, unit="seconds", why=_MAX_TTL_WHY)
        if ttl < self.min_ttl:
            raise ConfigError(
                f"{name} must be at least {self.min_ttl:g} seconds, got {value!r}: a round may take up "
                f"to request_timeout ({self.request_timeout:g} s) and the drift allowance is "
                f"ttl * drift_factor ({self.drift_factor:g}) + {CLOCK_DRIFT_FLOOR * 1000:g} ms, so a "
                "shorter TTL could be granted by every master and still leave no validity"
            )
        return ttl

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
        ``retraction``.
        """
        # Taken before the round makes any missing connection: all of the round, connects
        # included, is spent out of the TTL (and Lock counts its validity from earlier still).
        t_start = now()
        if acquires is None:
            acquires = [commands.acquire.pack(key, token, milliseconds(ttl))] * len(self.masters)
        with self._round() as rnd:
            outcomes = rnd.call(acquires, self.request_timeout)
            elapsed = now() - t_start
            if outcomes.count(GRANTED) == len(outcomes):  # the usual rounds: compared by identity
                votes, granted = list(self.tally.granted), len(outcomes)
            elif outcomes.count(HELD) == len(outcomes):
                votes, granted = list(self.tally.refused), 0
            else:
                votes, granted = self.tally.votes(outcomes, is_ok)
            validity = ttl - elapsed - self.drift(ttl)
            if expiry is not None:
                expiry.append(self._free_at(outcomes, t_start + elapsed))
            if seen is not None:
                seen.extend(outcomes)
            if granted >= self.quorum and validity > 0:
                if granted < len(votes):
                    # A master that answered late may still set the key; retract it on the same
                    # link (not waited for) so the key cannot outlive our release.
                    late = to_late(votes, retraction or commands.release.pack(key, token))
                    if any(late):
                        rnd.send(late, self.request_timeout)
                return validity, votes, elapsed
            retract = retraction_of(votes, undo or retraction or commands.release.pack(key, token))
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
            if isinstance(value, list) and value:
                value = value[0]  # a fair lock's refusal: [pttl, ...]
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
        command = commands.extend.pack(key, token, milliseconds(ttl))
        t_start = now()  # before the round's connects, as in try_acquire
        with self._round() as rnd:
            outcomes = rnd.call([command] * len(self.masters), self.request_timeout)
            elapsed = now() - t_start
        return self._extension(outcomes, ttl, elapsed)

    def _extension(
        self, outcomes: Sequence[Outcome], ttl: float, elapsed: float
    ) -> tuple[float, list[Vote], float]:
        """An extension's (validity, votes, elapsed) from every master's outcome of it."""
        votes, granted = self.tally.votes(outcomes, is_one)
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
            # Kept for a master that could not be written to: it goes out on that master's next
            # link, so the key does not outlive the release there until its TTL.
            outcomes = rnd.call(
                [command] * len(self.masters), self.request_timeout, keep=True, enough=self.quorum
            )
        if sum(1 for o in outcomes if o.kind == "ok") >= self.quorum:
            return True  # the hot path builds no votes
        if lock is not None:
            lock.release_votes = self.tally.votes(outcomes, is_answer)[0]
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
