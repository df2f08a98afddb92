"""Waiting woken by the release, for asyncio: one listening link per master per AsyncRedlock.

The rooms, waiters and every rule of who is woken by what (and the INVARIANT that no waiter
sleeps through a release it did not see) are :mod:`..rooms`', shared with the threaded
:mod:`..subscriber`, as are its timings (``ROOM_LINGER``, ``PING_EVERY``, ``PONG_WITHIN``,
``SILENT_RETRY``, the backoff): only the I/O is asyncio's here.

A listening link is a link of the transport's (its connect and handshake, identity checked, no
script loaded) whose protocol is then switched to an :class:`_Ear`, which parses the pushes and
applies them to the rooms as they come, in the loop. A *tender* task connects, subscribes,
unsubscribes the rooms that lingered empty, and pings an idle link (a blackholed one looks idle
for ever otherwise); it ends with no room for ``IDLE_EXIT`` seconds, and with ``aclose()``.
Waiters sleep on futures that every push (and every lost link) wakes to look again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import rooms, wire
from .. import subscriber as timings  # read at each use: tests shorten them
from ..clock import now
from ..rooms import Plan, Room, Waiter
from .link import let_go_in_a_child

if TYPE_CHECKING:
    from .exchange import AsyncTransport
    from .site import Site

logger = logging.getLogger("celery_redlock.aio.subscriber")

# How often the tender looks at its links when nothing wakes it (pings, retries, lingering rooms).
TEND_EVERY = 0.2


class _Ear(asyncio.Protocol):
    """A listening link's protocol: every push goes to the rooms at once."""

    def __init__(self, subscriber: AsyncSubscriber, listener: _Listener) -> None:
        self.subscriber = subscriber
        self.listener = listener
        self.reader = wire.Reader()
        self.transport: asyncio.Transport | None = None

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pushes = []
        try:
            while True:
                push = self.reader.get()
                if push is wire.NOTHING:
                    break
                pushes.append(push)
        except wire.ProtocolError as exc:
            self.subscriber._fail(self.listener, exc)
            return
        self.subscriber._heard(self.listener, pushes)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.listener.ear is self:
            lost = exc or ConnectionError("the master closed the listening link")
            self.subscriber._fail(self.listener, lost)


class _Listener:
    """One master's listening link and its state (see the module docstring)."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.index = site.index
        self.ear: _Ear | None = None
        self.connecting: asyncio.Task[Any] | None = None
        self.backoff = 0.0
        self.retry_at = 0.0
        self.sent: set[bytes] = set()  # channels a SUBSCRIBE was written for on this link
        self.ping_sent = 0.0  # when the unanswered PING went out (0.0: none outstanding)
        self.last_read = 0.0

    def write(self, command: Sequence[Any]) -> None:
        assert self.ear is not None and self.ear.transport is not None
        self.ear.transport.write(wire.pack(command))


class AsyncSubscriber:
    """The rooms and listening links of one AsyncRedlock (see the module docstring)."""

    def __init__(self, transport: AsyncTransport, request_timeout: float) -> None:
        self._transport = transport
        self._request_timeout = request_timeout
        self._rooms: dict[bytes, Room] = {}
        self._listeners = [_Listener(site) for site in transport.sites]
        self._tender: asyncio.Task[None] | None = None
        self._nudge: asyncio.Future[None] | None = None  # wakes the tender
        self._sleepers: set[asyncio.Future[None]] = set()  # wake on every push and loss
        self._closed = False

    # -- the waiters' side ------------------------------------------------------------------------
    async def join(self, key: str, deadline: float, member: str | None = None) -> Waiter:
        """A waiter in ``key``'s room; waits (by ``deadline``, on :func:`..clock.now`) for the
        masters to confirm the room's subscription, as ``Subscriber.join`` does."""
        room, waiter = rooms.enter(self._rooms, key.encode(), member)
        self._start()
        self._wake_tender()
        while True:
            # Every master is expected to confirm but one whose listening link failed and waits
            # out its backoff (down, or refusing SUBSCRIBE).
            t = time.monotonic()  # the listeners' retries are timed on it
            expected = {lst.index for lst in self._listeners if lst.ear is not None or lst.retry_at <= t}
            remaining = deadline - now()
            if expected <= room.confirmed or remaining <= 0:
                return waiter
            await self._doze(min(remaining, 0.05))

    def mark(self, key: str, waiter: Waiter) -> None:
        """Just before an attempt (see ``rooms.mark``)."""
        rooms.mark(self._rooms.get(key.encode()), waiter)

    async def sleep(self, waiter: Waiter, plan: Plan) -> bool:
        """Sleep until the notices ``plan`` waits for came (True), or its bound passed (False;
        see ``rooms.sleep_bound``)."""
        until = rooms.sleep_bound(waiter, plan.refusers, plan.needed, plan.until, plan.deaf_until)
        while True:
            if waiter.woken(plan.refusers, plan.needed):
                return True
            remaining = until - now()
            if remaining <= 0:
                return False
            await self._doze(remaining)

    def leave(self, key: str, waiter: Waiter) -> None:
        rooms.leave(self._rooms.get(key.encode()), waiter, time.monotonic())

    def listening(self) -> int:
        """How many masters have a listening link now (for tests and health reports)."""
        return sum(1 for lst in self._listeners if lst.ear is not None)

    async def _doze(self, seconds: float) -> None:
        """Sleep ``seconds``, or until a push or a lost link wakes every sleeper."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._sleepers.add(future)
        timer = loop.call_later(seconds, _settle, future)
        try:
            await future
        finally:
            timer.cancel()
            self._sleepers.discard(future)

    def _wake_sleepers(self) -> None:
        sleepers, self._sleepers = self._sleepers, set()
        for future in sleepers:
            _settle(future)

    # -- the tender -------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._closed:
            return
        if self._tender is None or self._tender.done():
            self._tender = asyncio.get_running_loop().create_task(self._tend(), name="redlock-subscriber")
            self._transport.tasks.add(self._tender)  # cancelled by the transport's aclose too
            self._tender.add_done_callback(self._transport.tasks.discard)

    def _wake_tender(self) -> None:
        if self._nudge is not None:
            _settle(self._nudge)

    async def _tend(self) -> None:
        loop = asyncio.get_running_loop()
        idle_since = time.monotonic()
        try:
            while not self._closed:
                now = time.monotonic()
                if self._rooms:
                    idle_since = now
                elif now - idle_since > timings.IDLE_EXIT:
                    return
                gone = rooms.lingered(self._rooms, now, timings.ROOM_LINGER)
                for listener in self._listeners:
                    self._tend_one(listener, set(self._rooms), gone, now)
                self._nudge = loop.create_future()
                timer = loop.call_later(TEND_EVERY, _settle, self._nudge)
                try:
                    await self._nudge
                finally:
                    timer.cancel()
                    self._nudge = None
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the asyncio subscriber failed; waiters fall back to polling")
        finally:
            self._drop_all()

    def _tend_one(
        self, listener: _Listener, subscribe: set[bytes], unsubscribe: set[bytes], now: float
    ) -> None:
        """Connect, (un)subscribe and ping one master's listening link, as due."""
        if listener.ear is None:
            self._connect(listener, now)
            return
        new = subscribe - listener.sent
        old = (unsubscribe & listener.sent) - subscribe
        if new:
            listener.write(("SUBSCRIBE", *sorted(new)))
            listener.sent |= new
        if old:
            listener.write(("UNSUBSCRIBE", *sorted(old)))
            listener.sent -= old
        if listener.ping_sent:
            if now - listener.ping_sent > timings.PONG_WITHIN:
                self._fail(listener, TimeoutError(f"no pong within {timings.PONG_WITHIN} s"))
        elif now - listener.last_read > timings.PING_EVERY:
            listener.write(("PING",))
            listener.ping_sent = now

    def _connect(self, listener: _Listener, now: float) -> None:
        if listener.connecting is not None or now < listener.retry_at or listener.site.unavailable():
            return
        task = asyncio.get_running_loop().create_task(self._open(listener, now + self._request_timeout))
        listener.connecting = task
        self._transport.tasks.add(task)
        task.add_done_callback(self._transport.tasks.discard)

    async def _open(self, listener: _Listener, deadline: float) -> None:
        try:
            link = await self._transport.open(listener.site, deadline, load_scripts=False)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(listener, exc)
            return
        finally:
            listener.connecting = None
        transport = link.transport
        if self._closed or transport is None or transport.is_closing():
            link.close()
            return
        ear = _Ear(self, listener)
        ear.transport = transport
        transport.set_protocol(ear)  # from now on its bytes are pushes, parsed by the ear
        let_go_in_a_child(ear)  # the link is dropped: a forked child must still reach its socket
        listener.ear = ear
        listener.backoff = 0.0
        listener.sent = set()
        listener.ping_sent = 0.0
        listener.last_read = time.monotonic()
        self._wake_tender()

    def _heard(self, listener: _Listener, pushes: list[Any]) -> None:
        listener.last_read = time.monotonic()
        for push in pushes:
            handle = rooms.dispatch(self._rooms, listener.index, push)
            if handle == "pong":
                listener.ping_sent = 0.0
            elif handle == "error":
                # NOPERM (an ACL without SUBSCRIBE), say: this master stays silent, its waiters
                # poll as without it, and no join waits for its confirmation meanwhile.
                listener.site.master.refused("refused SUBSCRIBE on a listening link", push)
                self._fail(listener, ConnectionError(str(push)))
                listener.retry_at = time.monotonic() + timings.SILENT_RETRY
                break
        self._wake_sleepers()

    def _fail(self, listener: _Listener, exc: BaseException) -> None:
        logger.debug("listening link to %s failed: %s", listener.site.master.name, exc)
        self._drop(listener)
        listener.backoff = min(timings.BACKOFF_CAP, max(timings.BACKOFF_FLOOR, 2 * listener.backoff))
        listener.retry_at = time.monotonic() + listener.backoff

    def _drop(self, listener: _Listener) -> None:
        ear, listener.ear = listener.ear, None
        listener.sent = set()
        listener.ping_sent = 0.0
        if ear is not None and ear.transport is not None:
            ear.transport.close()
        rooms.deaf(self._rooms.values(), listener.index)
        self._wake_sleepers()

    def _drop_all(self) -> None:
        for listener in self._listeners:
            self._drop(listener)
            task, listener.connecting = listener.connecting, None
            if task is not None:
                task.cancel()

    async def aclose(self) -> None:
        """Close the listening links and end the tender (a later wait would start it again,
        but the AsyncRedlock refuses to run once closed)."""
        self._closed = True
        tender = self._tender
        if tender is not None and not tender.done():
            tender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tender
        self._drop_all()
        self._wake_sleepers()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
