"""``AsyncRedlock``: the Redlock algorithm for asyncio, over the same rounds as ``Redlock``.

The algorithm is :mod:`..rounds` (and :func:`..fencing.fenced_attempt`,
:func:`..reentrant.enter`), the settings and their rules :class:`..settings.Settings`, a held
lock's state :class:`..state.LockState`: the threaded ``Redlock`` runs the very same code over
its blocking transports, this one over :mod:`.exchange`. Nothing here blocks the event loop,
and nothing of it outlives :meth:`AsyncRedlock.aclose`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..._fork import pid
from ..._validate import flag
from ...errors import ConfigError, Vote
from .. import rounds
from ..commands import PLAIN, Commands
from ..holder import holder_of, holder_read
from ..rounds import Steps
from ..settings import Settings, lock_kind
from ..state import lock_key
from ..transport.commands import Command
from .exchange import AsyncTransport, drive
from .fair import AsyncFairLock
from .lock import AsyncLock
from .reentrant import AsyncReentrantLock
from .subscriber import AsyncSubscriber

T = TypeVar("T")


class AsyncRedlock(Settings):
    """A lock factory over N independent Redis masters, for asyncio code.

    Takes ``Redlock``'s settings (``ttl``, ``retry_count``, ``retry_delay``, ``drift_factor``,
    ``request_timeout``, ``key_prefix``, ``wait``, ``wait_poll``, ``fence_retention``), with the
    same meaning and checks (``wait="release"``: an acquire with a timeout is woken by the
    holder's release, over one listening connection per master made at the first wait).
    ``masters`` are ``redis://``, ``rediss://`` (TLS, from redis-py's ``ssl_*`` options: see
    :mod:`.tls`) or ``unix://`` URLs (or ``redis.Redis`` clients, whose options are read).
    Connections are made on first use, in the running loop: an AsyncRedlock serves one event
    loop. ``await aclose()`` (or ``async with``) closes every connection and ends
    every task it started (connects, keep-alives, listening links, deliveries of releases).
    """

    TRANSPORTS = ("asyncio",)

    def _open(self) -> None:
        self.transport = AsyncTransport(self.masters, self.request_timeout)
        # The waiters' listening links; nothing is connected, and no task runs, until a wait.
        self.subscriber = AsyncSubscriber(self.transport, self.request_timeout)
        self._closed = False
        self.keepalives: set[asyncio.Task[None]] = set()  # the held locks' (see AsyncLock)
        # The reentrant locks' holdings: (key, owner) -> [inner lock, depth] (see reentrant.py).
        self.holdings: dict[tuple[str, str], list[Any]] = {}

    def __repr__(self) -> str:
        return f"<AsyncRedlock {len(self.masters)} masters quorum={self.quorum} ttl={self.ttl}s>"

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
        keepalive: bool = False,
    ) -> AsyncLock | AsyncReentrantLock:
        """An :class:`~.lock.AsyncLock` for one resource (nothing is sent until it is acquired);
        ``Redlock.lock``'s arguments. ``keepalive=True``: while held, a task of its own extends it
        every third of its TTL, and sets ``lock.lost`` (an ``asyncio.Event``) if it is lost.
        ``reentrant=True``: an :class:`~.reentrant.AsyncReentrantLock`, re-entered by the asyncio
        task that holds it. ``fair=True``: an :class:`~.fair.AsyncFairLock`, whose waiters take it
        in arrival order."""
        kind = lock_kind(reentrant=reentrant, fair=fair, fenced=fenced)
        flag("keepalive", keepalive)
        if kind == "fair":
            return AsyncFairLock(
                self, name, ttl, timeout=timeout, blocking=blocking, holder=holder, keepalive=keepalive
            )
        if kind == "reentrant":
            return AsyncReentrantLock(
                self, name, ttl, timeout=timeout, blocking=blocking, holder=holder, keepalive=keepalive
            )
        return AsyncLock(
            self,
            name,
            ttl,
            timeout=timeout,
            blocking=blocking,
            holder=holder,
            fenced=fenced,
            keepalive=keepalive,
        )

    def hold(self, name: str, ttl: float | None = None, **options: Any) -> AsyncLock:
        """``lock(name, ttl, keepalive=True, **options)``: a lock kept alive while held."""
        lock = self.lock(name, ttl, keepalive=True, **options)
        assert isinstance(lock, AsyncLock)
        return lock

    # -- the rounds, over asyncio -------------------------------------------------------------------
    def run(self, steps: Steps[T]) -> Coroutine[Any, Any, T]:
        """Run one operation of :mod:`..rounds` in an exchange of its own (await what this
        returns); its clock starts (``next(steps)``) before the exchange takes or makes any
        link. Not a coroutine itself: one coroutine less on every operation's path."""
        if self._closed:
            raise ConfigError("this AsyncRedlock is closed")
        first = next(steps)
        return drive(steps, self.transport.round(), first, close=True)

    # Each returns the awaitable of :meth:`run` (not a coroutine of its own: one layer less).
    def try_acquire(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> Coroutine[Any, Any, tuple[float, list[Vote], float]]:
        """One attempt: (validity, votes, elapsed), as ``Redlock.try_acquire``."""
        return self.run(rounds.attempt(self, key, token, ttl, commands))

    def try_extend(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> Coroutine[Any, Any, tuple[float, list[Vote], float]]:
        """Reset the TTL on every master that still holds ``token``: (validity, votes, elapsed)."""
        return self.run(rounds.extend(self, key, token, ttl, commands))

    def release_key(self, command: Command) -> Coroutine[Any, Any, list[Vote] | None]:
        """Compare-and-delete on every master: None once a quorum answered, else every vote."""
        return self.run(rounds.release(self, command))

    def send_release(self, command: Command) -> None:
        """A release nobody waits for, written now (a retraction; see ``rounds.send_release``)."""
        steps = rounds.send_release(self, command)
        first = next(steps)
        with self.transport.round() as exchange:
            assert isinstance(first, rounds.Send)
            exchange.send(first.commands, first.timeout)

    async def holder(self, name: str) -> str | None:
        """The ``holder`` text of the lock a quorum of masters holds on resource ``name`` ("" if
        it was taken without one), or None when no quorum holds one token (``Redlock.holder``).
        One round; asked by a contender, never on the way to a lock."""
        if self._closed:
            raise ConfigError("this AsyncRedlock is closed")
        read = holder_read(lock_key(self.key_prefix, name))
        with self.transport.round() as exchange:
            outcomes = await exchange.call([read] * len(self.masters), self.request_timeout)
        return holder_of(outcomes, self.quorum)

    async def aclose(self) -> None:
        """Close every connection and end every task this AsyncRedlock started (keep-alives
        first: a held lock is no longer extended, and expires with its TTL). In a forked child,
        only marks it closed: its tasks and connections are the parent's (the child let go of
        its copies of the sockets at the fork)."""
        self._closed = True
        if self.transport.pid != pid():
            return
        tasks = list(self.keepalives)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.subscriber.aclose()
        await self.transport.aclose()

    async def __aenter__(self) -> AsyncRedlock:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
