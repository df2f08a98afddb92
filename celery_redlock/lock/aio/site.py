"""One master as the asyncio transport keeps it: its idle links, its connects, when it is down,
and the releases kept for it.

- **Connects** are tasks of their own, each bounded by ``request_timeout`` (TCP, then the
  handshake: AUTH, CLIENT SETNAME, SELECT, ``INFO``, every ``SCRIPT LOAD``, in one write, as the
  fast transport's links do, read by :func:`.handshake.open_link`). A round waits for a connect
  by its own deadline only; one still under way then goes on, and its link serves a later round.
- **Down:** a failed connect puts the master down for a backoff doubling from ``BACKOFF_FLOOR``
  to ``BACKOFF_CAP``; meanwhile rounds vote ``error`` for it at once, costing nothing.
- **Kept:** a command that must not be lost (a release) that could not be written (no link by
  the deadline, a failed connect, a link lost before its reply) is kept here, and a delivery task
  writes it on the master's next link, retried after each backoff until it is written.
- **Owing:** a link given back while it still owes replies is not idle until they have come;
  past ``MAX_OWING_LINKS`` (a master that stopped answering) the oldest is closed.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .. import wire
from ..transport.commands import Outcome, pack_command
from ..transport.handshake import NOT_REDIS, Unfit
from ..transport.master import MAX_UNSENT, Master
from .link import Entry, Link

logger = logging.getLogger("celery_redlock.aio.site")

# Why a vote written on a link that was lost before its reply came failed (see unanswered).
LINK_LOST = "connection lost before the reply"

BACKOFF_FLOOR = 0.05
BACKOFF_CAP = 1.0
MAX_OWING_LINKS = 16
MAX_IDLE_LINKS = 64


class Site:
    """One master's links and state for one AsyncRedlock (see the module docstring)."""

    def __init__(
        self,
        index: int,
        master: Master,
        request_timeout: float,
        opener: Callable[[Site, float], Awaitable[Link]],
        tasks: set[asyncio.Task[Any]],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.index = index
        self.master = master
        self.tls = tls  # the context its links are wrapped in (rediss://), or None (see .tls)
        self.request_timeout = request_timeout
        self._opener = opener
        self._tasks = tasks  # the transport's: every task of ours, cancelled by aclose()
        self.idle: list[Link] = []
        self.owing: list[Link] = []
        self.kept: list[bytes] = []
        self.down_until = 0.0
        self.down_reason = ""
        self.backoff = 0.0
        self._delivering = False
        self.closed = False

    # -- links --------------------------------------------------------------------------------------
    def take(self) -> Link | None:
        """An idle link that owes nothing and is open, if there is one."""
        idle = self.idle
        while idle:
            link = idle.pop()
            if not link.closed and not link.owes():
                return link
            if not link.closed:
                self._owe(link)
        return None

    def give_back(self, link: Link) -> None:
        if link.closed:
            return
        if self.closed or self.master.refusal:
            link.close()
        elif link.owes():
            self._owe(link)
        elif len(self.idle) < MAX_IDLE_LINKS:
            self.idle.append(link)
        else:
            link.close()

    def _owe(self, link: Link) -> None:
        link.on_drained = self._drained
        self.owing.append(link)
        if len(self.owing) > MAX_OWING_LINKS:
            self.owing.pop(0).close()

    def _drained(self, link: Link) -> None:
        if link in self.owing:
            self.owing.remove(link)
            self.give_back(link)

    def unavailable(self) -> str:
        """Why no round should wait for a new link now (refused, unfit, down), or ""."""
        master = self.master
        if master.refusal or master.unfit:
            return master.refusal or master.unfit
        if self.down_until and time.monotonic() < self.down_until:
            return self.down_reason
        return ""

    def connect(self) -> asyncio.Task[Link]:
        """A connect begun now, bounded by ``request_timeout``, as a task of the transport's."""
        deadline = time.monotonic() + self.request_timeout
        task = asyncio.get_running_loop().create_task(self._connect(deadline))
        self._track(task)
        return task

    async def _connect(self, deadline: float) -> Link:
        try:
            link = await self._opener(self, deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, (Unfit, wire.ProtocolError)):
                # No Redis master of its own: refused for the AsyncRedlock's life, as by the
                # blocking transports (Master.unfit).
                what = str(exc) if isinstance(exc, Unfit) else f"not a Redis server: {exc}"
                self.master.unfit = f"refused: {what}"
                self.master.refused("is refused for the life of this Redlock", what, kind=NOT_REDIS)
            self._went_down(f"{type(exc).__name__}: {exc}")
            raise
        self.down_until = 0.0
        self.backoff = 0.0
        if self.kept:
            self._write_kept(link)
        return link

    def _went_down(self, reason: str) -> None:
        self.backoff = min(BACKOFF_CAP, max(BACKOFF_FLOOR, 2 * self.backoff))
        self.down_reason = f"down: {reason} (retried after {self.backoff:g} s)"
        self.down_until = time.monotonic() + self.backoff
        logger.debug("master %s is %s", self.master.name, self.down_reason)

    # -- kept commands ------------------------------------------------------------------------------
    def keep(self, packed: bytes) -> None:
        """Keep a command that must not be lost for the master's next link (see the module)."""
        if self.master.refusal or self.master.unfit:
            return  # another master's server, or none of ours: never contacted again
        self.kept.append(packed)
        if len(self.kept) > MAX_UNSENT:
            self.kept.pop(0)
            logger.warning("dropped a kept release for %s: over %d wait for it", self.master.name, MAX_UNSENT)
        self._deliver_soon()

    def unanswered(self, entries: list[Entry], why: str) -> None:
        """Entries this master will not answer: not written (no link, a failed connect), or
        written on a link lost before their replies. The releases among them are kept (a
        release sent twice deletes nothing more: its token is used once); a caller waiting for
        a reply is told now, as an error naming ``why``, and does not wait out its deadline.

        INVARIANT (a down master costs a bounded timeout, and nothing when it is known down):
        every entry written with a sink gets its outcome from a reply, from here, or from its
        call's deadline, whichever comes first. A link lost under a waiting vote (the master
        killed while the loop was busy) once left that vote to the deadline."""
        failure = Outcome("error", detail=why)
        for entry in entries:
            if entry.keep and entry.command is not None:
                self.keep(pack_command(entry.command))
            if entry.sink is not None:
                entry.sink.put(entry.slot, failure)

    def _write_kept(self, link: Link) -> None:
        kept, self.kept = self.kept, []
        link.write(b"".join(kept), [Entry(None, 0, packed, True) for packed in kept])

    def _deliver_soon(self) -> None:
        if self._delivering or self.closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # kept outside any loop (a link lost as its loop closed)
            return
        self._delivering = True
        self._track(loop.create_task(self._deliver()))

    async def _deliver(self) -> None:
        """Write the kept commands on a link of this master: an idle one, else a new one, after
        each failure's backoff, until they are written or the transport closes."""
        try:
            while self.kept and not self.closed:
                link = self.take()
                if link is not None:
                    self._write_kept(link)
                    self.give_back(link)
                    return
                wait = self.down_until - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                try:
                    link = await self.connect()  # writes them first
                except Exception:
                    continue  # down again: its backoff is the next wait
                self.give_back(link)
        finally:
            self._delivering = False

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(_forget(self._tasks))

    def close(self) -> None:
        self.closed = True
        links, self.idle, self.owing = self.idle + self.owing, [], []
        for link in links:
            link.close()


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            task.exception()  # retrieved: a failed connect is the site's news, not the loop's

    return done
