"""One connection to one master, driven without blocking: :class:`Link`."""

from __future__ import annotations

import logging
import select
import socket
import ssl
import time
import weakref
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._fork import let_go_of_inherited, on_fork_in_child
from .. import waiting, wire
from .commands import NOSCRIPT

if TYPE_CHECKING:
    from .master import Master

logger = logging.getLogger("celery_redlock.masters")


IO_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, wire.ProtocolError)
NOT_READY = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
RECV_SIZE = 65536
# What poll reports for a connection the master closed or reset. POLLRDHUP (Linux) tells a close
# even behind replies that arrived before it; elsewhere a close shows as readable, and the read
# finds the end of the stream.
_RDHUP = getattr(select, "POLLRDHUP", 0)
CLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | _RDHUP
# What an idle link is watched for: a reply, or the master closing it.
WATCH = select.POLLIN | _RDHUP


class Link:
    """One connection to one master, the replies it still owes us, and whether one is late.

    Owed replies belong to commands whose answer nobody waits for: a release (owed on time) or
    a command whose reply missed its deadline (late). They are read and skipped, in order,
    before the reply of the next command on this link.
    """

    __slots__ = (
        "__weakref__",
        "conn",
        "fd",
        "late",
        "master",
        "owed",
        "poller",
        "reader",
        "run_id",
        "sock",
        "tls",
    )
    conn: redis.Connection
    master: Master
    sock: socket.socket
    fd: int
    poller: waiting.Poller
    reader: wire.Reader
    owed: int
    late: bool
    tls: bool
    run_id: str  # the server's, from the handshake ("" if it would not say)

    def __init__(self, conn: redis.Connection, master: Master) -> None:
        self.conn = conn
        self.master = master  # told of the errors in replies nobody waits for
        sock = conn._sock  # redis-py has no public accessor for it
        assert sock is not None
        # Non-blocking: our poll decides when to read, so no call here can wait on its own.
        sock.settimeout(0.0)
        self.sock = sock
        self.fd = sock.fileno()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.poller = waiting.poll()  # this socket alone, for waiting on its reply
        self.poller.register(self.fd, WATCH)
        self.reader = wire.Reader()
        self.owed = 0
        self.late = False
        self.run_id = ""
        _made.add(self)  # see _close_inherited

    def usable(self) -> bool:
        """Whether this idle link may carry a command: the master has not closed it. One
        ``poll(0)``, no round trip (a round checks all its links in one: see :func:`checked`)."""
        events = self.poller.poll(0)
        return not events or self.settle(events[0][1])

    def settle(self, events: int) -> bool:
        """Whether an idle link that ``poll`` found with ``events`` may carry a command.

        Readable: either the replies owed on time have arrived (they are read now, as the next
        send would have read them), or the master closed or reset the connection while it sat
        idle (its ``timeout``, ``CLIENT KILL``, a restart), and a command written to it now
        would be lost: a release silently.
        """
        if events & CLOSED:
            return False
        if _RDHUP and self.owed:
            # Linux tells a close apart from arrived data (POLLRDHUP), so readable here means
            # the owed replies are in: they are left for the next read, which takes them and
            # that command's own reply in one recv.
            return True
        try:
            self.fill()
        except IO_ERRORS:
            return False
        self.skip_owed()
        # Bytes beyond the owed replies answer nothing we sent: the stream is out of step.
        return self.owed > 0 or not self.reader.buffered()

    def exchange(self, packed: bytes, count: int, deadline: float) -> list[Any]:
        """Send ``packed`` (``count`` commands) and read their replies by ``deadline``: a new
        link's handshake, before anything else goes out on it."""
        self.send(packed, deadline)
        replies: list[Any] = []
        while len(replies) < count:
            reply = self.reader.get()
            if reply is not wire.NOTHING:
                replies.append(reply)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.poller.poll(remaining * 1000):
                raise RedisTimeoutError("no answer to the handshake within request_timeout")
            self.fill()
        return replies

    def send(self, packed: bytes, deadline: float) -> None:
        """Write ``packed``: whole in one system call as a rule; only a full socket buffer (the
        master stopped reading) waits, by ``deadline``."""
        try:
            sent = self.sock.send(packed)
        except NOT_READY:
            sent = 0
        if sent < len(packed):
            self.send_rest(memoryview(packed)[sent:], deadline)

    def send_rest(self, data: memoryview, deadline: float) -> None:
        """Write what a send left over, by ``deadline``: only when the socket buffer is full,
        i.e. the master has stopped reading."""
        poller = waiting.poll()
        poller.register(self.sock.fileno(), select.POLLOUT)
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise RedisTimeoutError("the master stopped reading; command not sent in time")
            try:
                data = data[self.sock.send(data) :]
            except NOT_READY:
                continue

    def fill(self) -> None:
        """Take whatever bytes have arrived, without waiting."""
        try:
            data = self.sock.recv(RECV_SIZE)
        except NOT_READY:
            return
        if not data:
            raise RedisConnectionError("the master closed the connection")
        self.reader.feed(data)
        # TLS: bytes already decrypted sit inside the SSL object, where poll cannot see them.
        if self.tls:
            sock: Any = self.sock
            while sock.pending():
                self.reader.feed(sock.recv(RECV_SIZE))

    def read_reply(self) -> Any:
        """Take whatever has arrived, then this link's next own reply or ``wire.NOTHING``.

        A round reads the usual reply (nothing buffered, no TLS) with a bare ``recv`` of its own
        (see ``Round._read``), and hands what that returned to :meth:`take` unless it was the
        usual short line."""
        reader = self.reader
        # Bytes already read in (the later replies of a pipelined batch) may hold the reply
        # whole: it is taken without a system call; only a part of one waits for more.
        if reader._position < len(reader._buffer) and (not self.owed or self.skip_owed()):
            reply = reader.get()
            if reply is not wire.NOTHING:
                return reply
        self.fill()
        if self.owed and not self.skip_owed():
            return wire.NOTHING
        return reader.get()

    def take(self, data: bytes) -> Any:
        """This link's next own reply or ``wire.NOTHING``, from ``data``, what a ``recv`` just
        returned with nothing buffered before it."""
        if not data:
            raise RedisConnectionError("the master closed the connection")
        self.reader.feed(data)
        if self.owed and not self.skip_owed():
            return wire.NOTHING
        return self.reader.get()

    def skip_owed(self) -> bool:
        """Skip the owed replies already read in; True once none is owed."""
        while self.owed:
            skipped = self.reader.get()
            if skipped is wire.NOTHING:
                return False
            self.owed -= 1
            if isinstance(skipped, wire.ReplyError):
                # A release refused (NOPERM for a user without EVALSHA, READONLY on a replica, or
                # NOSCRIPT: the master's scripts were flushed under this live link, and nothing
                # ran) leaves the lock held until its TTL: nobody waits for this reply, so it
                # cannot be sent again as EVAL (see scripts.py), and this report is its only trace.
                what = "ran nothing of" if skipped.startswith(NOSCRIPT) else "refused"
                self.master.refused(f"{what} a command nobody waited for", skipped)
        self.late = False
        return True

    def drain(self) -> bool:
        """Read late replies that have already arrived; True when nothing is owed any more."""
        self.fill()
        return self.skip_owed()

    def close(self) -> None:
        try:
            self.conn.disconnect()
        except Exception:  # closing a broken socket may fail; it is being thrown away anyway
            logger.debug("error while closing a link", exc_info=True)


# Every link this process made, held weakly: a forked child closes its copies of their sockets.
_made: weakref.WeakSet[Link] = weakref.WeakSet()


def _close_inherited() -> None:
    """In a forked child: let go of the child's copy of the socket of every link the parent made.

    The owners of the links drop them in the child (Master, FastTransport, Subscriber), which
    closes a copy once nothing holds it. But a link that another thread of the parent held at
    the fork (a connector thread that had just made it, a heartbeat or a listener mid-round)
    is held for ever in the child: CPython does not free the frames of the threads that did
    not survive a fork. Its connection would stay open on the master for as long as the child
    lives, after the parent is gone (see ``_fork.let_go_of_inherited``).
    """
    links = list(_made)
    _made.clear()
    let_go_of_inherited(link.sock for link in links)


on_fork_in_child(_close_inherited)


class Generation:
    """Counts Master.close() calls (a refusal closes its master too): a link set parked before
    the latest one is not trusted whole (see LinkSet)."""

    value = 0


def pop_usable(stack: list[Link]) -> Link | None:
    """The newest link of ``stack`` the master has not closed; closed ones are dropped."""
    while stack:
        try:
            link = stack.pop()  # atomic: no mutex
        except IndexError:
            return None  # another thread took the last one
        if link.usable():
            return link
        link.close()
    return None
