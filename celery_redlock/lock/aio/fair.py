"""Fair asyncio locks: waiters queue on the masters and take the lock in arrival order.

``AsyncRedlock.lock(name, fair=True)``. Everything a fair lock sends and learns (tickets, the
probe/join/keep modes, the arrival-order INVARIANT, leaving the queue) is
:class:`..fair.Queue`'s, shared with the threaded :class:`..fair.FairLock`; the wait is
:class:`~.lock.AsyncLock`'s, woken only by a release that names this waiter (``rooms.notice``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import Vote
from ..fair import Entry, Queue
from ..rounds import attempt
from ..transport.commands import Command, Outcome
from .lock import AsyncLock

if TYPE_CHECKING:
    from .redlock import AsyncRedlock


class AsyncFairLock(AsyncLock):
    """An :class:`AsyncLock` whose waiters take it in arrival order (see ``FairLock``: a blocking
    ``acquire()`` without a timeout waits up to ``(retry_count + 1) * retry_delay``; a
    non-blocking one never queues)."""

    def __init__(self, redlock: AsyncRedlock, name: str, ttl: float | None = None, **options: Any) -> None:
        super().__init__(redlock, name, ttl, **options)
        self._queue = Queue(redlock, self.key, self.ttl)

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        return await super().acquire(blocking, self._queue.timeout(blocking, timeout))

    def _entry(self) -> Entry:
        return self._queue.entry()

    async def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Any
    ) -> tuple[float, list[Vote], float, int]:
        modes, acquires = self._queue.acquires(token, entry)
        seen: list[Outcome] = []
        expiry.clear()
        steps = attempt(
            self.redlock,
            self.key,
            token,
            self.ttl,
            expiry=expiry,
            acquires=acquires,
            retraction=self._queue.retraction(token, entry),
            seen=seen,
        )
        validity, votes, elapsed = await self.redlock.run(steps)
        self._queue.take_in(entry, modes, seen)
        return validity, votes, elapsed, 0

    def _retraction(self, token: str, entry: Any) -> Command:
        return self._queue.retraction(token, entry)

    def _granted(self, entry: Any) -> None:
        self._queue.member = entry.member

    def _joins_next(self, entry: Any) -> bool:
        return self._queue.joins_next(entry)

    def _leave(self, entry: Any) -> None:
        command = self._queue.leaving(entry)
        if command is not None:
            self.redlock.send_release(command)

    def _commands_release(self, token: str) -> Command:
        return self._queue.release(token)
