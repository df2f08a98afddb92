"""The Redlock algorithm over N independent masters. Knows nothing of Celery.

Acquire, as the Redis documentation describes it:

1. note the monotonic time, t_start;
2. try to set the key to a fresh random token with the TTL on every master at once;
3. the lock is held iff a majority (N//2 + 1) granted it and the validity left,
   ``ttl - (t_end - t_start) - (ttl * drift_factor + 2 ms)``, is positive;
4. otherwise release on every master (also those that did not answer: the write may have
   landed) and try again after a random delay.

The holder may only act on the resource while the validity lasts; :meth:`Lock.extend` renews it
on a quorum, and cannot revive a key that expired or that another token holds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from . import scripts, wire
from .errors import ConfigError, LockLost, LockNotAcquired, RedlockError, Vote
from .linger import Lingering
from .masters import GRANTED, Command, Master, Outcome, Round, script_template

logger = logging.getLogger("celery_redlock.redlock")

# Names longer than this are shortened to a readable head plus a digest of the whole name.
MAX_NAME_LENGTH = 512
CLOCK_DRIFT_FLOOR = 0.002
MAX_RELEASE_LINGER = 1.0

# The commands, packed from templates: only key, token and TTL are encoded per call.
ACQUIRE = wire.Template(("SET", wire.SLOT, wire.SLOT, "NX", "PX", wire.SLOT))  # key token <ms>
RELEASE = script_template(scripts.RELEASE, 1, 1)  # key token
EXTEND = script_template(scripts.EXTEND, 1, 2)  # key token <ms>


class RedlockWarning(UserWarning):
    """A configuration that works but weakens the lock's guarantees."""


def _number(name: str, value: object, *, minimum: float, inclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive):
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ConfigError(f"{name} must be {bound}, got {value!r}")
    return float(value)


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

    ``release_linger`` (seconds, 0 by default) lets a release wait that long at most to travel
    with this process's next round to the masters instead of in one of its own (see
    :mod:`celery_redlock.linger`); ``Lock.release(linger=False)`` still sends at once.
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
    ) -> None:
        if isinstance(masters, (str, bytes)):
            masters = [masters]
        specs = list(masters)
        if not specs:
            raise ConfigError("masters: at least one master is needed")
        self.ttl = _number("ttl", ttl, minimum=0)
        if isinstance(retry_count, bool) or not isinstance(retry_count, int) or retry_count < 0:
            raise ConfigError(f"retry_count must be an int >= 0, got {retry_count!r}")
        self.retry_count = retry_count
        self.retry_delay = _number("retry_delay", retry_delay, minimum=0, inclusive=True)
        self.drift_factor = _number("drift_factor", drift_factor, minimum=0, inclusive=True)
        if self.drift_factor >= 0.5:
            raise ConfigError(f"drift_factor must be < 0.5, got {drift_factor!r}")
        self.request_timeout = _number("request_timeout", request_timeout, minimum=0)
        if not isinstance(key_prefix, str):
            raise ConfigError(f"key_prefix must be a str, got {key_prefix!r}")
        self.key_prefix = key_prefix
        self.release_linger = _number("release_linger", release_linger, minimum=0, inclusive=True)
        if self.release_linger > MAX_RELEASE_LINGER:
            raise ConfigError(
                f"release_linger must be at most {MAX_RELEASE_LINGER} s (it delays every "
                f"release by up to that much), got {release_linger!r}"
            )

        self.masters: list[Master] = [Master.from_spec(s, self.request_timeout) for s in specs]
        names = [m.name for m in self.masters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(
                f"masters: {', '.join(duplicates)} listed more than once; each master must be an "
                "independent server, or one server would cast several votes"
            )
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
        self._lingering = (
            Lingering(self.release_linger, self._send_released) if self.release_linger else None
        )

    def __repr__(self) -> str:
        return f"<Redlock {len(self.masters)} masters quorum={self.quorum} ttl={self.ttl}s>"

    # -- public factory --------------------------------------------------------------------------
    def lock(
        self, name: str, ttl: float | None = None, *, timeout: float | None = None,
        blocking: bool = True,
    ) -> Lock:
        """A :class:`Lock` for one resource. Nothing is sent until it is acquired."""
        return Lock(self, name, ttl, timeout=timeout, blocking=blocking)

    def flush_releases(self) -> None:
        """Send every lingering release now (see ``release_linger``)."""
        if self._lingering is not None:
            self._lingering.flush()

    def close(self) -> None:
        """Send any lingering releases, then close every idle connection."""
        if self._lingering is not None:
            self._lingering.close()
        for master in self.masters:
            master.close()

    def __enter__(self) -> Redlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the algorithm ----------------------------------------------------------------------------
    def drift(self, ttl: float) -> float:
        return ttl * self.drift_factor + CLOCK_DRIFT_FLOOR

    def _round(self) -> Round:
        # Lingering releases ride along with whatever this round sends first.
        lingering = self._lingering
        return Round(self.masters, lingering.take() if lingering is not None else ())

    def _send_released(self, commands: Sequence[Command]) -> None:
        with Round(self.masters, commands) as rnd:
            rnd.send([None] * len(self.masters), self.request_timeout)

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

    def try_acquire(self, key: str, token: str, ttl: float) -> tuple[float, list[Vote], float]:
        """One attempt. Returns (validity, votes, elapsed); validity > 0 means acquired.

        On failure every master is sent the release on the link the acquire used, so a late
        write is always followed by its deletion.
        """
        acquire = ACQUIRE.pack(key, token, int(ttl * 1000))
        with self._round() as rnd:
            t_start = time.monotonic()
            outcomes = rnd.call([acquire] * len(self.masters), self.request_timeout)
            elapsed = time.monotonic() - t_start
            if outcomes.count(GRANTED) == len(outcomes):  # the usual round: compared by identity
                votes, granted = list(self._granted_votes), len(outcomes)
            else:
                votes, granted = self._votes(outcomes, granted=b"OK")
            validity = ttl - elapsed - self.drift(ttl)
            if granted >= self.quorum and validity > 0:
                if granted < len(votes):
                    # A master that answered late may still set the key; retract it on the same
                    # link (not waited for) so the key cannot outlive our release.
                    release = RELEASE.pack(key, token)
                    late = [release if v.kind == "timeout" else None for v in votes]
                    if any(late):
                        rnd.send(late, self.request_timeout)
                return validity, votes, elapsed
            release = RELEASE.pack(key, token)
            # A master that answered "held" refused our SET: nothing of ours is there to delete.
            # Every other one (yes, error, timeout) may hold our token and gets the release.
            retract = [None if v.kind == "held" else release for v in votes]
            if any(retract):
                rnd.send(retract, self.request_timeout)
        return min(validity, 0.0), votes, elapsed

    def try_extend(self, key: str, token: str, ttl: float) -> tuple[float, list[Vote], float]:
        """Reset the TTL on every master that still holds ``token``; (validity, votes, elapsed)."""
        command = EXTEND.pack(key, token, int(ttl * 1000))
        with self._round() as rnd:
            t_start = time.monotonic()
            outcomes = rnd.call([command] * len(self.masters), self.request_timeout)
            elapsed = time.monotonic() - t_start
        votes, granted = self._votes(outcomes)
        validity = ttl - elapsed - self.drift(ttl)
        return (validity if granted >= self.quorum else 0.0), votes, elapsed

    def release_key(self, key: str, token: str, *, linger: bool = True) -> None:
        """Send the compare-and-delete to every master, without waiting for the replies.

        Each master applies it as it arrives, before anything this process sends it later on
        that connection; the acknowledgements are read by the connection's next use. Waiting
        would only tell us what expiry makes true anyway, at the price of a round trip. With
        ``release_linger`` set (and ``linger``), it waits to travel with the next round.
        """
        command = RELEASE.pack(key, token)
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

    def holders(self, key: str) -> int:
        """How many masters hold ``key`` at all (by any token)."""
        with self._round() as rnd:
            outcomes = rnd.call([("EXISTS", key)] * len(self.masters), self.request_timeout)
        return sum(1 for o in outcomes if o.kind == "ok" and o.value == 1)


def _valid_until(started: float, ttl: float, redlock: Redlock) -> float:
    """When a grant asked for at ``started`` stops being safe to act on (monotonic clock).

    Anchored before the round was sent, never at the moment its result is looked at: a holder
    stalled between the round and that moment (a long GC, a SIGSTOP) must not come back believing
    it holds a lock that the masters already let expire.
    """
    return started + ttl - redlock.drift(ttl)


class Lock:
    """One resource's lock on a :class:`Redlock`. Shareable across threads.

    Use ``acquire``/``release`` or ``with``. ``validity`` is how many seconds of guaranteed
    hold are left; act on the resource only while ``owned()`` is true.
    """

    def __init__(
        self, redlock: Redlock, name: str, ttl: float | None = None, *,
        timeout: float | None = None, blocking: bool = True,
    ) -> None:
        self.redlock = redlock
        self.key = lock_key(redlock.key_prefix, name)
        self.name = name
        self.ttl = redlock.ttl if ttl is None else _number("ttl", ttl, minimum=0)
        self._timeout = timeout
        self._blocking = blocking
        self._token: str | None = None
        self._valid_until = 0.0
        self._lost_reason = ""
        self._op = threading.Lock()
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
                self.name, votes, attempts=attempts, elapsed=elapsed, validity=validity,
                quorum=self.redlock.quorum,
            )
        return self._last_error

    @property
    def token(self) -> str | None:
        return self._token

    @property
    def validity(self) -> float:
        if self._token is None or self._lost_reason:
            return 0.0
        return max(0.0, self._valid_until - time.monotonic())

    @property
    def lost_reason(self) -> str:
        """Why the lock was lost ("" while held or never acquired)."""
        return self._lost_reason

    def owned(self) -> bool:
        return self.validity > 0.0

    def locked(self) -> bool:
        """Whether a quorum of masters holds this resource, by any token."""
        return self.redlock.holders(self.key) >= self.redlock.quorum

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Try to take the lock; True once held. Like ``threading.Lock.acquire``.

        ``blocking=False`` tries one round. Otherwise retries after a random delay in
        ``[0, retry_delay)``: until ``timeout`` seconds have passed, or, with no timeout, for
        ``retry_count`` more attempts.
        """
        if timeout is not None:
            if not blocking:
                raise ConfigError("timeout cannot be given with blocking=False")
            _number("timeout", timeout, minimum=0, inclusive=True)
        if self.owned():
            raise RedlockError(f"lock {self.name!r} is already held by this Lock")
        redlock = self.redlock
        deadline = None if timeout is None else time.monotonic() + timeout
        attempts = 0
        while True:
            attempts += 1
            # 20 bytes from the operating system's CSPRNG (what the secrets module reads too).
            token = os.urandom(20).hex()
            with self._op:
                started = time.monotonic()
                validity, votes, elapsed = redlock.try_acquire(self.key, token, self.ttl)
                self.last_votes = votes
                if validity > 0:
                    self._token = token
                    self._valid_until = _valid_until(started, self.ttl, redlock)
                    self._lost_reason = ""
                    self._failure = self._last_error = None
                    logger.debug("acquired %s in %.2f ms (validity %.3f s)", self.key,
                                 elapsed * 1000, validity)
                    return True
            # Built only when asked for: a contended loop fails far more often than it looks.
            self._failure = (votes, attempts, elapsed, validity)
            self._last_error = None
            if not blocking:
                return False
            delay = random.uniform(0, redlock.retry_delay)
            if deadline is None:
                if attempts > redlock.retry_count:
                    return False
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                delay = min(delay, remaining)
            time.sleep(delay)

    def extend(self, ttl: float | None = None) -> bool:
        """Renew the lock to a full ``ttl`` (default: its own) on a quorum; False if lost.

        A failed extension leaves the validity the lock already had; it is lost for good when
        the masters that no longer hold the token leave no quorum possible.
        """
        ttl = self.ttl if ttl is None else _number("ttl", ttl, minimum=0)
        with self._op:
            token = self._token
            if token is None or self._lost_reason or not self.owned():
                return False
            started = time.monotonic()
            validity, votes, _ = self.redlock.try_extend(self.key, token, ttl)
            self.last_votes = votes
            if validity > 0 and self._token == token:
                self._valid_until = _valid_until(started, ttl, self.redlock)
                return True
            gone = sum(1 for v in votes if v.kind == "held")
            if gone > len(votes) - self.redlock.quorum:
                self._lost_reason = (
                    f"{gone} of {len(votes)} masters no longer hold this token"
                )
            logger.debug("extension of %s failed: %s", self.key, "; ".join(map(str, votes)))
            return False

    def release(self, *, linger: bool = True) -> None:
        """Release on every master. Releasing a lock not held (or already gone) does nothing.

        Returns once the release is on its way to every reachable master (see
        :meth:`Redlock.release_key`); it does not wait a round trip for the acknowledgements.
        If the Redlock has a ``release_linger``, the release may wait that long for company;
        ``linger=False`` sends it at once.
        """
        with self._op:
            token, self._token = self._token, None
            self._valid_until = 0.0
            self._lost_reason = ""
        if token is not None:
            self.redlock.release_key(self.key, token, linger=linger)

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock is still owned."""
        if not self.owned():
            reason = self._lost_reason or (
                "validity ran out" if self._token is not None else "not acquired"
            )
            raise LockLost(self.name, reason)

    def __enter__(self) -> Lock:
        if not self.acquire(self._blocking, self._timeout):
            assert self.last_error is not None
            raise self.last_error
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
