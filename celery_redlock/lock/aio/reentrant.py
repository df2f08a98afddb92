"""Reentrant asyncio locks: the asyncio task that holds one may acquire it again.

As :mod:`..reentrant` (whose commands, owner rule and re-entry round this shares): a view
holding no token of its own; each owner (:func:`..owner.current_owner`: the asyncio task, or a
scope opened in it) that acquires it gets a *holding*, an inner :class:`~.lock.AsyncLock` sending
the reentrant scripts, and a depth. A re-entry is one ``R_ENTER`` round (``reentrant.enter``),
settled as an extension; inner exits send ``R_EXIT`` without waiting; the last exit releases.
The registry is per AsyncRedlock (one event loop's), keyed by (key, owner).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ...errors import LockLost, LockNotAcquired
from ..clock import now
from ..commands import EXIT, REENTRANT, Commands
from ..owner import current_owner
from ..reentrant import enter
from ..state import check_wait, raise_on_kind
from .lock import AsyncLock, named

if TYPE_CHECKING:
    from .redlock import AsyncRedlock


class _Inner(AsyncLock):
    _commands: Commands = REENTRANT
    _waiting_commands: Commands = REENTRANT  # R_ACQUIRE answers a held key with its PTTL already


class AsyncReentrantLock:
    """A lock its asyncio task may acquire again while holding it (see the module docstring)."""

    def __init__(self, redlock: AsyncRedlock, name: str, ttl: float | None = None, **options: Any) -> None:
        self._options = options
        self._template = _Inner(redlock, name, ttl, **options)  # checks the arguments now
        self.redlock = redlock
        self.name = name
        self.key = self._template.key
        self.ttl = self._template.ttl
        self._last_error: LockNotAcquired | None = None

    def _registry(self) -> dict[tuple[str, str], list[Any]]:
        return self.redlock.holdings

    def holding(self) -> AsyncLock | None:
        """The asking task's inner lock, or None."""
        found = self._registry().get((self.key, current_owner()))
        return found[0] if found is not None else None

    @property
    def depth(self) -> int:
        found = self._registry().get((self.key, current_owner()))
        return int(found[1]) if found is not None else 0

    @property
    def validity(self) -> float:
        inner = self.holding()
        return inner.validity if inner is not None else 0.0

    def owned(self) -> bool:
        return self.validity > 0.0

    @property
    def last_error(self) -> LockNotAcquired | None:
        return self._last_error

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        check_wait(blocking, timeout)
        ident = (self.key, current_owner())
        registry = self._registry()
        found = registry.get(ident)
        if found is None:
            inner = _Inner(self.redlock, self.name, self.ttl, **self._options)
            if not await inner.acquire(blocking, timeout):
                self._last_error = inner.last_error
                return False
            registry[ident] = [inner, 1]
            self._last_error = None
            return True
        inner = found[0]
        async with inner._op:
            token = inner._extendable()
            if token is None:
                raise LockLost(self.name, inner.lost_reason or "validity ran out before the re-entry")
            before = now()
            try:
                validity, votes, started = await self.redlock.run(
                    enter(self.redlock, self.key, token, inner.ttl)
                )
            except asyncio.CancelledError:
                # Any master may have applied it (R_ENTER sets the TTL to inner.ttl, shorter
                # than an earlier extend() may have left): settled as a failed extension, as a
                # cancelled extend() is, so owned() never outlasts the masters' keys.
                inner._settle_extension(token, before, inner.ttl, 0.0, list(self.redlock.tally.granted))
                raise
            raise_on_kind(self.name, votes)
            inner._settle_extension(token, started, inner.ttl, validity, votes)
        if inner.lost_reason or not inner.owned():
            raise LockLost(self.name, inner.lost_reason or "validity ran out during the re-entry")
        found[1] += 1
        return True

    async def release(self) -> bool:
        ident = (self.key, current_owner())
        registry = self._registry()
        found = registry.get(ident)
        if found is None:
            return True
        found[1] -= 1
        inner: AsyncLock = found[0]
        if found[1] <= 0:
            del registry[ident]
            return await inner.release()
        token = inner.token
        if token is not None:  # an inner exit frees nothing: nobody waits for it
            command = EXIT.pack(self.key, token)
            with self.redlock.transport.round() as exchange:
                exchange.send([command] * len(self.redlock.masters), self.redlock.request_timeout)
        return True

    async def extend(self, ttl: float | None = None) -> bool:
        inner = self.holding()
        return await inner.extend(ttl) if inner is not None else False

    def ensure(self) -> None:
        inner = self.holding()
        if inner is None:
            raise LockLost(self.name, "not acquired by this owner")
        inner.ensure()

    async def __aenter__(self) -> AsyncReentrantLock:
        t = self._template
        if not await self.acquire(t._blocking, t._timeout):
            raise await named(self.redlock, self.name, self.last_error)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()
