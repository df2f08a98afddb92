"""``AsyncRedlock``: the Redlock algorithm for asyncio, over the same rounds as ``Redlock``.

The algorithm is :mod:`..rounds` (and :func:`..fencing.fenced_attempt`,
:func:`..reentrant.enter`), the settings and their rules :class:`..settings.Settings`, a held
lock's state :class:`..state.LockState`: the threaded ``Redlock`` runs the very same code over
its blocking transports, this one over :mod:`.exchange`. Nothing here blocks the event loop,
and nothing of it outlives :meth:`AsyncRedlock.aclose`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, TypeVar

from ..._validate import flag
from ...errors import ConfigError, Vote
from .. import rounds
from ..commands import PLAIN, Commands
from ..rounds import Steps
from ..settings import Settings
from ..transport.commands import Command
from .exchange import AsyncTransport, drive
from .lock import AsyncLock
from .reentrant import AsyncReentrantLock

T = TypeVar("T")


class AsyncRedlock(Settings):
    """A lock factory over N independent Redis masters, for asyncio code.

    Takes ``Redlock``'s settings (``ttl``, ``retry_count``, ``retry_delay``, ``drift_factor``,
    ``request_timeout``, ``key_prefix``, ``wait``, ``wait_poll``, ``fence_retention``), with the
    same meaning and checks; ``masters`` are ``redis://`` or ``unix://`` URLs (or ``redis.Redis``
    clients, whose options are read). Connections are made on first use, in the running loop:
    an AsyncRedlock serves one event loop. ``await aclose()`` (or ``async with``) closes every
    connection and ends every task it started (connects, keep-alives, deliveries of releases).
    """

    def __init__(self, masters: Iterable[str | Any], **settings: Any) -> None:
        if settings.pop("transport", "asyncio") != "asyncio":
            raise ConfigError("AsyncRedlock has one transport, asyncio")
        super().__init__(masters, **settings)
        self.transport = AsyncTransport(self.masters, self.request_timeout)
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
        fenced: bool = False,
        keepalive: bool = False,
    ) -> AsyncLock | AsyncReentrantLock:
        """An :class:`~.lock.AsyncLock` for one resource (nothing is sent until it is acquired);
        ``Redlock.lock``'s arguments. ``keepalive=True``: while held, a task of its own extends it
        every third of its TTL, and sets ``lock.lost`` (an ``asyncio.Event``) if it is lost.
        ``reentrant=True``: an :class:`~.reentrant.AsyncReentrantLock`, re-entered by the asyncio
        task that holds it."""
        for option, value in (("fenced", fenced), ("keepalive", keepalive), ("reentrant", reentrant)):
            flag(option, value)
        if reentrant:
            if fenced:
                raise ConfigError("fenced=True cannot be combined with reentrant=True")
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
    async def run(self, steps: Steps[T]) -> T:
        """Run one operation of :mod:`..rounds` in an exchange of its own; its clock starts
        (``next(steps)``) before the exchange takes or makes any link."""
        if self._closed:
            raise ConfigError("this AsyncRedlock is closed")
        first = next(steps)
        with self.transport.round() as exchange:
            return await drive(steps, exchange, first)

    async def try_acquire(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> tuple[float, list[Vote], float]:
        return await self.run(rounds.attempt(self, key, token, ttl, commands))

    async def try_extend(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> tuple[float, list[Vote], float]:
        return await self.run(rounds.extend(self, key, token, ttl, commands))

    async def release_key(self, command: Command) -> list[Vote] | None:
        """Compare-and-delete on every master: None once a quorum answered, else every vote."""
        return await self.run(rounds.release(self, command))

    def send_release(self, command: Command) -> None:
        """A release nobody waits for, written now (a retraction; see ``rounds.send_release``)."""
        steps = rounds.send_release(self, command)
        first = next(steps)
        with self.transport.round() as exchange:
            assert isinstance(first, rounds.Send)
            exchange.send(first.commands, first.timeout)

    async def aclose(self) -> None:
        """Close every connection and end every task this AsyncRedlock started (keep-alives
        first: a held lock is no longer extended, and expires with its TTL)."""
        self._closed = True
        tasks = list(self.keepalives)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.transport.aclose()

    async def __aenter__(self) -> AsyncRedlock:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
