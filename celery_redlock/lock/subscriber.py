"""Waiting woken by the release: one subscriber per Redlock, one listening link per master.

The release script deletes the key and publishes on a channel named after it in one atomic step
(see :mod:`.scripts`). A blocked ``Lock.acquire(timeout=...)`` joins the *room* of its key here,
and sleeps until notices from enough masters arrive, instead of polling the masters.

The words (notice, room, waiter, confirmed), the INVARIANT that no waiter sleeps through a
release it did not see, and every rule of who is woken by what are :mod:`.rooms`' (shared with
the asyncio subscriber); this module keeps them over blocking links, under one condition.

Threads: one daemon thread, ``redlock-subscriber``, does all the I/O of the listening links (they
are never shared with rounds: a subscribed connection answers only pushes). Waiters talk to it
through the rooms, under one condition, and a wake-up socket. It exits after
:data:`IDLE_EXIT` seconds with no room, and with its Redlock's ``close()``. A forked child starts
with no rooms, no links and no thread: everything here was the parent's.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from .._fork import on_fork_in_child
from . import rooms, waiting, wire
from .rooms import Room, Waiter
from .transport.link import Link
from .transport.master import Master
from .transport.threads import spawn

logger = logging.getLogger("celery_redlock.subscriber")

# A room nobody waits in stays subscribed this long, so a hot name pays no new SUBSCRIBE.
ROOM_LINGER = 10.0
# With no room at all for this long, the thread closes its links and exits.
IDLE_EXIT = 60.0
# An idle listening link is pinged this often; a pong later than PONG_WITHIN means it is broken
# (a blackholed connection looks idle for ever otherwise).
PING_EVERY = 5.0
PONG_WITHIN = 1.0
# A master that refused SUBSCRIBE is asked again this much later (its ACL may change).
SILENT_RETRY = 60.0
# A listening link that failed is reconnected after a backoff doubling within these bounds.
BACKOFF_FLOOR = 0.05
BACKOFF_CAP = 1.0
_CLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


class _Listener:
    """One master's listening link and its state; touched by the subscriber thread only."""

    __slots__ = (
        "backoff",
        "connecting",
        "index",
        "last_read",
        "link",
        "master",
        "ping_sent",
        "retry_at",
        "sent",
    )

    def __init__(self, index: int, master: Master) -> None:
        self.index = index
        self.master = master
        self.link: Link | None = None
        self.connecting: Future[Link] | None = None
        self.backoff = 0.0
        self.retry_at = 0.0
        self.sent: set[bytes] = set()  # channels a SUBSCRIBE was written for on this link
        self.ping_sent = 0.0  # when the unanswered PING went out (0.0: none outstanding)
        self.last_read = 0.0


class Subscriber:
    """The rooms and listening links of one Redlock (see the module docstring)."""

    def __init__(self, masters: Sequence[Master], request_timeout: float) -> None:
        self._masters = list(masters)
        self._request_timeout = request_timeout
        self._reset()
        on_fork_in_child(self._reset)

    def _reset(self) -> None:
        # Also the fork handler: the parent's links, thread and wake-up socket are dropped
        # unused (closing them here could shut the parent's connections down).
        self._cond = threading.Condition()
        self._rooms: dict[bytes, Room] = {}
        self._listeners = [_Listener(i, m) for i, m in enumerate(self._masters)]
        self._thread: threading.Thread | None = None
        self._wake_pair: tuple[socket.socket, socket.socket] | None = None
        self._stopping = False

    # -- the waiters' side ------------------------------------------------------------------------
    def join(self, key: str, deadline: float, member: str | None = None) -> Waiter:
        """A waiter in ``key``'s room; waits (by ``deadline``) for the masters to confirm the
        room's subscription, so the first attempt after this can rely on them. A fair waiter
        passes its ``member``."""
        with self._cond:
            room, waiter = rooms.enter(self._rooms, key.encode(), member)
            self._start()
            self._wake()
            while True:
                # Every master is expected to confirm but one whose listening link failed and
                # waits out its backoff (down, or refusing SUBSCRIBE).
                now = time.monotonic()
                expected = {
                    lst.index for lst in self._listeners if lst.link is not None or lst.retry_at <= now
                }
                remaining = deadline - now
                if expected <= room.confirmed or remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.05))
        return waiter

    def mark(self, key: str, waiter: Waiter) -> None:
        """Call just before an attempt: notices before this point are forgotten; the masters
        confirmed now are those the attempt may rely on."""
        with self._cond:
            rooms.mark(self._rooms.get(key.encode()), waiter)

    def sleep(
        self,
        key: str,
        waiter: Waiter,
        refusers: frozenset[int],
        needed: int,
        until: float,
        deaf_until: float,
        cancelled: Callable[[], bool] | None,
    ) -> str:
        """Sleep until notices from ``needed`` of ``refusers`` arrived since the mark (returns
        ``"notice"``), ``until`` passes (``"time"``), or ``cancelled()`` says so (``"cancelled"``).

        Bounded by ``deaf_until`` when too few refusers listened (``rooms.sleep_bound``); a
        subscription confirmed meanwhile still counts as a notice and ends it sooner.
        """
        with self._cond:
            until = rooms.sleep_bound(waiter, refusers, needed, until, deaf_until)
        while True:
            with self._cond:
                if waiter.woken(refusers, needed):
                    return "notice"
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return "time"
                # Slices of at most 0.5 s, so a cancellation is seen soon.
                self._cond.wait(min(remaining, 0.5))
                if waiter.woken(refusers, needed):
                    return "notice"
            # Asked without the condition held: the callable is the caller's, and may take locks
            # of its own (a thread holding one of those may be joining a room meanwhile).
            if cancelled is not None and cancelled():
                return "cancelled"

    def leave(self, key: str, waiter: Waiter) -> None:
        with self._cond:
            rooms.leave(self._rooms.get(key.encode()), waiter, time.monotonic())

    def close(self) -> None:
        """Stop the thread, which closes the listening links; a later join starts it again."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            self._wake()
        if thread is not threading.current_thread():
            thread.join(2.0)

    def listening(self) -> int:
        """How many masters have a listening link now (for tests and health reports)."""
        with self._cond:
            return sum(1 for lst in self._listeners if lst.link is not None)

    # -- the thread ------------------------------------------------------------------------------
    def _start(self) -> None:
        """Start the thread unless it runs (call holding the condition)."""
        self._stopping = False
        if self._thread is not None and self._thread.is_alive():
            return
        if self._wake_pair is None:
            pair = socket.socketpair()
            for end in pair:
                end.setblocking(False)
            self._wake_pair = pair
        self._thread = threading.Thread(target=self._run, name="redlock-subscriber", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        if self._wake_pair is not None:
            with contextlib.suppress(OSError):  # full: a wake-up is pending already
                self._wake_pair[1].send(b"x")

    def _run(self) -> None:
        idle_since = time.monotonic()
        try:
            while True:
                with self._cond:
                    now = time.monotonic()
                    if self._rooms:
                        idle_since = now
                    if self._stopping or now - idle_since > IDLE_EXIT:
                        self._exit()
                        return
                    subscribe, unsubscribe = self._plan(now)
                for listener in self._listeners:
                    self._tend(listener, subscribe, unsubscribe, now)
                self._poll_once()
        except BaseException:
            logger.exception("the subscriber thread failed; waiters fall back to polling")
            with self._cond:
                self._exit()

    def _exit(self) -> None:
        """Close every listening link and let a later join start a new thread (call holding
        the condition: a join then finds either this thread running or no thread at all)."""
        for listener in self._listeners:
            self._drop(listener)
            if listener.connecting is not None:
                listener.connecting.add_done_callback(_close_result)
                listener.connecting = None
        self._thread = None
        self._cond.notify_all()

    def _plan(self, now: float) -> tuple[set[bytes], set[bytes]]:
        """The channels to be subscribed, and those whose rooms lingered empty long enough."""
        gone = rooms.lingered(self._rooms, now, ROOM_LINGER)
        return set(self._rooms), gone

    def _tend(self, listener: _Listener, subscribe: set[bytes], unsubscribe: set[bytes], now: float) -> None:
        """Connect, (un)subscribe and ping one master's listening link, as due."""
        if listener.link is None:
            self._connect(listener, now)
            if listener.link is None:
                return
        link = listener.link
        deadline = now + self._request_timeout
        try:
            new = subscribe - listener.sent
            old = (unsubscribe & listener.sent) - subscribe
            if new:
                link.send(wire.pack(("SUBSCRIBE", *sorted(new))), deadline)
                listener.sent |= new
            if old:
                link.send(wire.pack(("UNSUBSCRIBE", *sorted(old))), deadline)
                listener.sent -= old
            if listener.ping_sent:
                if now - listener.ping_sent > PONG_WITHIN:
                    raise TimeoutError(f"no pong within {PONG_WITHIN} s")
            elif now - listener.last_read > PING_EVERY:
                link.send(wire.pack(("PING",)), deadline)
                listener.ping_sent = now
        except Exception as exc:
            self._fail(listener, exc)

    def _connect(self, listener: _Listener, now: float) -> None:
        future = listener.connecting
        if future is None:
            if now < listener.retry_at or listener.master.refusal:
                return
            # On a connector thread: a connect never holds up the reading of the other links.
            master = listener.master
            listener.connecting = spawn(master._open, now + self._request_timeout, False)  # runs no script
            if listener.connecting is not None:
                listener.connecting.add_done_callback(lambda _: self._wake())
            return
        if not future.done():
            return
        listener.connecting = None
        try:
            link = future.result()
        except Exception as exc:
            self._fail(listener, exc)
            return
        listener.link = link
        listener.backoff = 0.0
        listener.sent = set()
        listener.ping_sent = 0.0
        listener.last_read = now

    def _fail(self, listener: _Listener, exc: BaseException) -> None:
        logger.debug("listening link to %s failed: %s", listener.master.name, exc)
        self._drop(listener)
        listener.backoff = min(BACKOFF_CAP, max(BACKOFF_FLOOR, 2 * listener.backoff))
        listener.retry_at = time.monotonic() + listener.backoff

    def _drop(self, listener: _Listener) -> None:
        link, listener.link = listener.link, None
        listener.sent = set()
        listener.ping_sent = 0.0
        if link is not None:
            link.close()
        with self._cond:
            rooms.deaf(self._rooms.values(), listener.index)
            self._cond.notify_all()

    def _poll_once(self) -> None:
        poller = waiting.poll()
        assert self._wake_pair is not None
        wake_fd = self._wake_pair[0].fileno()
        poller.register(wake_fd, select.POLLIN)
        by_fd: dict[int, _Listener] = {}
        for listener in self._listeners:
            if listener.link is not None:
                by_fd[listener.link.fd] = listener
                poller.register(listener.link.fd, select.POLLIN | getattr(select, "POLLRDHUP", 0))
        # Woken by data, by a waiter (a new room) or a finished connect; else at the next ping or
        # retry that may be due.
        for fd, events in poller.poll(BACKOFF_FLOOR * 1000 * 4):
            if fd == wake_fd:
                try:
                    while self._wake_pair[0].recv(4096):
                        pass
                except OSError:
                    pass
                continue
            listener = by_fd[fd]
            self._read(listener, events)

    def _read(self, listener: _Listener, events: int) -> None:
        link = listener.link
        assert link is not None
        try:
            if events & select.POLLIN:
                link.fill()
            elif events & _CLOSED:
                raise ConnectionError("the master closed the listening link")
            pushes = []
            while True:
                push = link.reader.get()
                if push is wire.NOTHING:
                    break
                pushes.append(push)
            if not pushes and events & _CLOSED:
                raise ConnectionError("the master closed the listening link")
        except Exception as exc:
            self._fail(listener, exc)
            return
        listener.last_read = time.monotonic()
        with self._cond:
            for push in pushes:
                self._dispatch(listener, push)
            self._cond.notify_all()

    def _dispatch(self, listener: _Listener, push: Any) -> None:
        """One push from ``listener``'s master (call holding the condition)."""
        handle = rooms.dispatch(self._rooms, listener.index, push)
        if handle == "pong":
            listener.ping_sent = 0.0
        elif handle == "error":
            # NOPERM (an ACL without SUBSCRIBE), say: this master stays silent, its waiters
            # poll as without it, and no join waits for its confirmation meanwhile.
            listener.master.refused("refused SUBSCRIBE on a listening link", push)
            self._fail(listener, ConnectionError(str(push)))
            listener.retry_at = time.monotonic() + SILENT_RETRY


def _close_result(future: Future[Link]) -> None:
    """A connect that finished after its subscriber stopped: its link is closed unused."""
    with contextlib.suppress(Exception):  # a failed connect leaves nothing to close
        future.result().close()
