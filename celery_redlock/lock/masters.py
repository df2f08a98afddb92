"""The N masters and the one fan-out primitive every Redlock operation goes through.

A :class:`Round` takes one connection ("link") per master, writes a command to every link, then
reads every reply against one shared deadline: N masters cost one round trip, and a dead or
paused master costs at most ``request_timeout``, never a hang and never a hidden retry.

Ordering is what keeps a lock from being left behind. A link whose reply did not arrive in time
is not closed: it is marked as owing that reply, and any follow-up for the same key (the release
after a failed acquire, or the retraction of a late vote) is written to that *same* link, so the
master executes it after the late command. A link that owes replies is drained before it is
reused and is never handed to another operation while it still owes them.

A release is *sent* and not waited for: its replies are owed on time, not late, and are read
and skipped by the link's next use, before that use's own reply. The masters apply the release
as soon as it arrives; only the acknowledgement is read later.

Links are opened by redis-py (name resolution, TCP, TLS) and then driven here, non-blocking,
through :mod:`.wire`: one ``send`` per master, one ``poll`` for all of them, one ``recv`` per
reply, and nothing hidden in between (the poll is :mod:`.waiting`'s: ``select.poll`` itself,
or its stand-in under eventlet). The handshake is ours: AUTH, CLIENT SETNAME, SELECT and
``INFO server`` pipelined in one write, so a new link costs one round trip after the TCP (and
TLS) handshake, and tells which server it reached (its ``run_id``).

The connect path, and its words:

- A round costs one ``request_timeout`` at most, connects included. A link that no idle stack
  can give is *connected* on a connector thread (name resolution too: ``getaddrinfo`` has no
  timeout, so it never runs on a round's path); the round's first command waits for it by that
  command's own deadline and goes out on it as soon as it is there. A connect still under way
  at the deadline goes on: its link is *fresh*, kept for a later round.
- An idle link is *checked* before it carries anything: one ``poll(0)`` over all the round's
  links, no round trip, tells a link whose owed replies have arrived (they are left to be read
  with its next reply) from one the master closed while it sat idle (its ``timeout``,
  ``CLIENT KILL``, a restart), which is dropped and replaced within the round: a vote or a
  release written to it would be lost.
- A master whose connect failed is *down*: rounds vote ``error`` for it at once, and its
  connect is retried on a timer thread of its own, after a *backoff* doubling from
  ``BACKOFF_FLOOR`` to ``BACKOFF_CAP``, until one succeeds: the master is up again with that
  retry's fresh link, within ``BACKOFF_CAP`` of its return whether rounds come meanwhile or not.
- A command nobody waits for (a release, carried releases) that a round could not write to a
  master (down, its connect not done by the deadline, a failed write) is *kept* on the master
  and written first on its next new link, or by a delivery task (see ``MAX_UNSENT``): never
  dropped. A round with no idle link always begins its own connect, however many are under way.
- A round that ends cleanly (every master has a link, none late) leaves its links *parked* as
  one :class:`LinkSet`, and the next round takes the set whole: one pop and one ``poll(0)``
  where five idle stacks would cost a loop over the masters to take, check and give back. A set
  is trusted only in the process and the master generation it was parked in (see LinkSet).
- Every new link is *identified* before it carries anything: a server whose ``run_id``
  another master of the round already has is one server reached twice (a proxy, an alias, one
  of its other databases). Both masters are then *refused*: their links are closed, and every
  later call raises ``ConfigError`` naming both, so one server never casts two votes.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

from .._fork import on_fork_in_child, pid
from ..errors import ConfigError
from . import scripts, waiting, wire

logger = logging.getLogger("celery_redlock.masters")

# A command as its arguments, or already packed (bytes) by a wire.Template.
Command = tuple[Any, ...] | bytes
_IO_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, wire.ProtocolError)
_NOT_READY = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
RECV_SIZE = 65536
# What poll reports for a connection the master closed or reset. POLLRDHUP (Linux) tells a close
# even behind replies that arrived before it; elsewhere a close shows as readable, and the read
# finds the end of the stream.
_RDHUP = getattr(select, "POLLRDHUP", 0)
_CLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | _RDHUP
# What an idle link is watched for: a reply, or the master closing it.
_WATCH = select.POLLIN | _RDHUP

# A master whose connect failed is down: no round waits for it, and its connect is retried on a
# timer thread, BACKOFF_FLOOR after the failure and then twice as long after each failure, up to
# BACKOFF_CAP. A dead master costs a round nothing (and the process one connect attempt per
# BACKOFF_CAP); a restarted one is back within BACKOFF_CAP plus one connect.
BACKOFF_FLOOR = 0.05
BACKOFF_CAP = 1.0
# A round that finds no idle link for a master begins a connect of its own, however many are
# under way already (others' connects serve their own rounds): a burst of rounds on a healthy
# master must never vote error, or send its releases nowhere, for want of a link.
#
# Commands nobody waits for (a release, the releases a round carries) that a round could not
# write to a master (no link: down, or its connect not done by the deadline; or the write
# failed) are *kept* on the master and written before anything else on its next new link, or
# by a delivery task on a connector thread (see Master.keep_unsent): a release must not vanish
# because a link was missing at the moment it was made. They are compare-and-delete releases of
# tokens never used again (one per acquisition attempt), so one written late, or twice after a
# partial write, deletes nothing but its own key; one kept longer than its lock's TTL is moot.
# Past this many per master (a master down for long under a busy process) the oldest are dropped,
# and their keys expire with their TTL: memory stays bounded (~300 bytes each).
MAX_UNSENT = 1024
# Links to a master that stopped answering pile up while each one waits for its late replies;
# past this many, the oldest is closed.
MAX_OWING_LINKS = 16
# A master that refuses our commands (an ACL user without EVAL, a replica, a full server, a
# cluster node, a server that is not Redis) is reported at WARNING at most this often per master
# and per kind of error (the error's first word: NOPERM, READONLY, MOVED, ...): every release
# may fail the same way, and one line per release would drown the log.
REFUSAL_REPORT_INTERVAL = 60.0
# How long building a Redlock may wait for the masters' host names to resolve (all at once),
# to find two names of one server; a name not resolved by then is compared as written.
RESOLVE_TIMEOUT = 1.0


@dataclass(frozen=True, eq=False)
class Outcome:
    """One master's answer to one command: a reply, an error, or no answer in time.

    Compared by identity (``eq=False``): the usual outcomes are shared objects (see
    ``_COMMON_OK``), so a round counts its grants with ``list.count`` at C speed.
    """

    kind: Literal["ok", "error", "timeout"]
    value: Any = None
    detail: str = ""


_NOT_SENT = Outcome("error", detail="not sent")
# A master's answer to EVALSHA of a script it does not have (restarted, SCRIPT FLUSH): nothing ran.
NOSCRIPT = "NOSCRIPT"
_LATE = Outcome("timeout", detail="no reply within request_timeout")
_QUEUED_BEHIND_LATE = Outcome("timeout", detail="queued behind a reply that is late")
# Why a Sentinel-managed master is refused.
_FAILOVER = (
    "Redlock needs independent masters, each reached directly: a failover-managed master loses "
    "its locks on failover (the replica promoted in its place may never have received them, and "
    "grants them again), so give one redis:// URL per master server"
)
# The kind under which a server that does not speak RESP is reported, wherever it shows.
_NOT_REDIS = "not-redis"
# Lock commands answer with one of a handful of values; their outcomes are shared, not rebuilt
# once per master per round (Outcome is immutable).
_COMMON_OK = {value: Outcome("ok", value) for value in (b"OK", 1, 0, None)}


def common_outcome(value: Any) -> Outcome:
    """The shared outcome of a reply ``value`` (b"OK", 1, 0 or None): compare by identity."""
    return _COMMON_OK[value]


# The outcome of a granted SET, shared by every master that granted one, and of a SET NX
# refused because the key is there.
GRANTED = _COMMON_OK[b"OK"]
HELD = _COMMON_OK[None]


def _packed(command: Command) -> bytes:
    return command if type(command) is bytes else wire.pack(command)


def _is_echo(reply: list[Any], command: Command) -> bool:
    """Whether ``reply`` is ``command`` sent back as it was written (an echo server's answer)."""
    return all(type(item) is bytes for item in reply) and wire.pack(reply) == _packed(command)


class Link:
    """One connection to one master, the replies it still owes us, and whether one is late.

    Owed replies belong to commands whose answer nobody waits for: a release (owed on time) or
    a command whose reply missed its deadline (late). They are read and skipped, in order,
    before the reply of the next command on this link.
    """

    __slots__ = ("conn", "fd", "late", "master", "owed", "poller", "reader", "run_id", "sock", "tls")
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
        self.poller.register(self.fd, _WATCH)
        self.reader = wire.Reader()
        self.owed = 0
        self.late = False
        self.run_id = ""

    def usable(self) -> bool:
        """Whether this idle link may carry a command: the master has not closed it. One
        ``poll(0)``, no round trip (a round checks all its links in one: see :func:`_checked`)."""
        events = self.poller.poll(0)
        return not events or self.settle(events[0][1])

    def settle(self, events: int) -> bool:
        """Whether an idle link that ``poll`` found with ``events`` may carry a command.

        Readable: either the replies owed on time have arrived (they are read now, as the next
        send would have read them), or the master closed or reset the connection while it sat
        idle (its ``timeout``, ``CLIENT KILL``, a restart), and a command written to it now
        would be lost: a release silently.
        """
        if events & _CLOSED:
            return False
        if _RDHUP and self.owed:
            # Linux tells a close apart from arrived data (POLLRDHUP), so readable here means
            # the owed replies are in: they are left for the next read, which takes them and
            # that command's own reply in one recv.
            return True
        try:
            self.fill()
        except _IO_ERRORS:
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
        except _NOT_READY:
            sent = 0
        if sent < len(packed):
            self._send_rest(memoryview(packed)[sent:], deadline)

    def _send_rest(self, data: memoryview, deadline: float) -> None:
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
            except _NOT_READY:
                continue

    def fill(self) -> None:
        """Take whatever bytes have arrived, without waiting."""
        try:
            data = self.sock.recv(RECV_SIZE)
        except _NOT_READY:
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
        """Take whatever has arrived, then this link's next own reply or ``wire.NOTHING``."""
        reader = self.reader
        if reader._position < len(reader._buffer):  # reader.buffered(), inlined: once per reply
            # Bytes already read in (the later replies of a pipelined batch) may hold the reply
            # whole: it is taken without a system call; only a part of one waits for more.
            if not self.owed or self.skip_owed():
                reply = reader.get()
                if reply is not wire.NOTHING:
                    return reply
            self.fill()
        elif self.tls:
            self.fill()
        else:
            try:
                data = self.sock.recv(RECV_SIZE)
            except _NOT_READY:
                return wire.NOTHING  # nothing buffered and nothing new
            if not data:
                raise RedisConnectionError("the master closed the connection")
            # The usual recv: exactly the owed replies and ours, each a short line. Taken whole,
            # it needs no parsing; anything else goes through the reader.
            run = wire.SHORT_RUNS.get(data)
            if run is not None and run[0] == self.owed + 1:
                self.owed = 0
                self.late = False
                return run[1]
            reader.feed(data)
        if self.owed and not self.skip_owed():
            return wire.NOTHING
        return reader.get()

    def skip_owed(self) -> bool:
        """Skip the owed replies already read in; True once none is owed."""
        while self.owed:
            skipped = self.reader.get()
            if skipped is wire.NOTHING:
                return False
            self.owed -= 1
            if isinstance(skipped, wire.ReplyError):
                # A release refused (NOPERM for a user without EVAL, READONLY on a replica)
                # leaves the lock held until its TTL: nobody waits for this reply, so this report
                # is the only trace of it.
                self.master.refused("refused a command nobody waited for", skipped)
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


def _connection_options(
    connection_class: type[redis.Connection], kwargs: dict[str, Any], request_timeout: float
) -> dict[str, Any]:
    options = dict(kwargs)
    options.update(
        socket_timeout=request_timeout,
        socket_connect_timeout=request_timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        retry_on_error=[],
        health_check_interval=0,
        socket_keepalive=True,
        protocol=2,  # wire.Reader parses RESP2
        redis_connect_func=_no_handshake,
    )
    # redis-py 8 turns on "maintenance notifications" for URLs, which it refuses to run on a
    # RESP2 connection without hiredis; they are push messages we would not read anyway.
    options.pop("maint_notifications_config", None)
    options.pop("maint_notifications_pool_handler", None)
    if issubclass(connection_class, redis.UnixDomainSocketConnection):
        options.pop("socket_keepalive", None)
    return options


def _no_handshake(conn: AbstractConnection) -> None:
    """Stands in for redis-py's handshake (a round trip per command): see Master._handshake."""


def _run_id(info: object) -> str:
    """The ``run_id`` of an ``INFO server`` reply ("" where there is none)."""
    if not isinstance(info, bytes):
        return ""
    start = info.find(b"\nrun_id:")
    if start < 0:
        return ""
    end = info.find(b"\r\n", start + 1)
    return info[start + 8 : end if end >= 0 else len(info)].decode("ascii", "replace")


def describe(connection_class: type[redis.Connection], kwargs: dict[str, Any]) -> str:
    """How a master is named in messages: host:port, or its socket path (plus a non-zero db)."""
    if issubclass(connection_class, redis.UnixDomainSocketConnection):
        name = str(kwargs.get("path"))
    else:
        name = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    db = int(kwargs.get("db") or 0)
    return f"{name}/{db}" if db else name


class Master:
    """One independent Redis master: its name, its options, a small stack of idle links, and
    whether it is down or refused (see the module docstring)."""

    def __init__(
        self,
        name: str,
        connection_class: type[redis.Connection],
        kwargs: dict[str, Any],
        request_timeout: float,
    ) -> None:
        self.name = name
        self._connection_class = connection_class
        self._options = _connection_options(connection_class, kwargs, request_timeout)
        self._request_timeout = request_timeout
        self._idle: list[Link] = []
        self._owing: list[Link] = []
        self._fresh: list[Link] = []  # connected off a round's path; identified by the next round
        self._mutex = threading.Lock()
        self.run_id = ""  # its server's, as the last new link found it ("" until known)
        self.refusal = ""  # why it may never vote (it is another master's server), or ""
        self._down_until = 0.0  # when the next background retry may begin; 0.0 while up
        self._down_reason = ""
        self._backoff = 0.0
        self._retrying = False  # a retry is scheduled or under way (see _schedule_retry)
        self._closed = False  # close() stops the retries; a round that needs the master resumes them
        # Kept commands nobody waits for, packed, each with how many it holds (see MAX_UNSENT).
        self._unsent: list[tuple[bytes, int]] = []
        self._unsent_count = 0
        self._delivering = False  # a delivery task is scheduled or under way (see keep_unsent)
        self._failed_at = 0.0  # when a connect last failed
        # Kind of refusal -> when it may be reported again (see REFUSAL_REPORT_INTERVAL).
        self._quiet_until: dict[str, float] = {}
        on_fork_in_child(self._after_fork_in_child)

    @classmethod
    def from_spec(cls, spec: object, request_timeout: float) -> Master:
        """A master from a redis URL or a ``redis.Redis`` client (only its options are used)."""
        if isinstance(spec, redis.Redis):
            pool = spec.connection_pool
            connection_class = pool.connection_class
            if isinstance(pool, SentinelConnectionPool) or issubclass(
                connection_class, SentinelManagedConnection
            ):
                raise ConfigError(f"masters: {spec!r} is a Sentinel-managed client; {_FAILOVER}")
            kwargs = dict(pool.connection_kwargs)
        elif isinstance(spec, str):
            scheme = urlparse(spec).scheme
            if "sentinel" in scheme:
                raise ConfigError(f"masters: {spec!r} is a Sentinel URL; {_FAILOVER}")
            if scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(
                    f"masters: {spec!r} is not a redis URL (expected redis://, rediss:// or unix://)"
                )
            try:
                pool = redis.ConnectionPool.from_url(spec)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"masters: cannot parse {spec!r}: {exc}") from None
            connection_class = pool.connection_class
            kwargs = dict(pool.connection_kwargs)
            is_unix = issubclass(connection_class, redis.UnixDomainSocketConnection)
            if not is_unix and not kwargs.get("host"):
                raise ConfigError(f"masters: {spec!r} names no host")
        elif isinstance(spec, redis.Sentinel):
            raise ConfigError(f"masters: {spec!r} is a Sentinel client; {_FAILOVER}")
        elif isinstance(spec, redis.RedisCluster):
            raise ConfigError(
                f"masters: {spec!r} is a Redis Cluster client; Redlock needs independent masters, "
                "each a server of its own that is not a cluster node (a cluster moves keys between "
                "its nodes and fails over to replicas that never saw a lock): give one redis:// URL "
                "per server"
            )
        else:
            raise ConfigError(
                f"masters: expected a redis URL or a redis.Redis client, got {type(spec).__name__}"
            )
        return cls(describe(connection_class, kwargs), connection_class, kwargs, request_timeout)

    def refused(self, what: str, error: str, kind: str = "") -> None:
        """Report at WARNING that this master refused us (``error``: its reply or the failure),
        at most once per ``REFUSAL_REPORT_INTERVAL`` per kind (default: the error's first word).

        Only ever called on an error path: the usual round pays nothing for it.
        """
        kind = kind or error.split(" ", 1)[0]
        now = time.monotonic()
        # Read and written without the mutex: two threads refused at the same moment may both
        # report, which costs a log line, where a mutex would be one more thing a fork can break.
        if now < self._quiet_until.get(kind, 0.0):
            return
        self._quiet_until[kind] = now + REFUSAL_REPORT_INTERVAL
        logger.warning(
            "master %s %s: %s (reported at most once a minute for this master and kind of error)",
            self.name,
            what,
            error,
        )

    def _after_fork_in_child(self) -> None:
        # The parent's sockets are not ours to use: the links are dropped, never drained (a
        # read would take replies the parent is waiting for) and never shut down (that would
        # end the parent's connection too); a dropped socket only closes the child's copy of
        # the descriptor. The mutex is replaced, not taken (see celery_redlock._fork).
        self._idle = []
        self._owing = []
        self._fresh = []
        self._mutex = threading.Lock()
        # The parent's connector threads did not survive the fork: nothing is under way here.
        self._down_until = 0.0
        self._backoff = 0.0
        self._retrying = False
        # The parent's kept releases are the parent's to send.
        self._unsent = []
        self._unsent_count = 0
        self._delivering = False

    def take_idle(self) -> Link | None:
        """An idle link with no late reply (it may owe replies on time), if one is ready,
        *unchecked*: whether the master closed it is for the caller to ask (see :func:`_checked`)."""
        if self._owing:
            self._drain_owing()
        try:
            return self._idle.pop()  # list.pop is atomic: the common case needs no mutex
        except IndexError:
            return None

    def take_checked(self) -> Link | None:
        """An idle link as :meth:`take_idle` gives, that the master has not closed (one
        ``poll(0)`` per link taken); closed ones are dropped."""
        link = self.take_idle()
        if link is None or link.usable():
            return link
        link.close()
        return _pop_usable(self._idle)

    def _drain_owing(self) -> None:
        with self._mutex:
            still_owing = []
            for link in self._owing:
                try:
                    if link.drain():
                        self._idle.append(link)
                        continue
                except _IO_ERRORS:
                    link.close()
                    continue
                still_owing.append(link)
            self._owing = still_owing

    def take_fresh(self) -> Link | None:
        """A link connected off a round's path (a retry, or a connect its round gave up on)."""
        return _pop_usable(self._fresh)

    def unavailable(self) -> str:
        """Why no round should wait for a new link to this master now, or "" (it may).

        Down: the last connect failed. The round votes ``error`` at once; the retries go on on a
        timer thread, and the link of the first that succeeds is fresh for the next round. Asked
        only when the master had no link for a round (off the usual path).
        """
        down_until = self._down_until
        if down_until:
            if not self._retrying:  # stopped by close(), or lost in a fork: resume them
                self._closed = False
                self._schedule_retry(down_until - time.monotonic())
            return self._down_reason
        return ""

    def _schedule_retry(self, delay: float) -> None:
        """Retry the connect after ``delay`` seconds, on a timer thread, and again after each
        failure, backed off, until one succeeds or the master is closed. One chain per master."""
        with self._mutex:
            if self._retrying or self._closed:
                return
            self._retrying = True
        # The timer holds the master weakly: a Redlock dropped without close() ends the chain.
        timer = threading.Timer(max(0.0, delay), _retry_master, args=(weakref.ref(self),))
        timer.name = "redlock-reconnect"
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # the interpreter is exiting
            self._retrying = False

    def _retry(self) -> None:
        link = None
        if not self._closed:
            try:
                link = self.connect(time.monotonic() + self._request_timeout)
            except RedisConnectionError:
                pass  # still down: connect() set a longer backoff
            except Exception:  # a bug must not end the retries
                logger.exception("reconnecting to %s failed", self.name)
        if link is not None:
            self._fresh.append(link)
        with self._mutex:
            self._retrying = False
        if link is None:
            self._schedule_retry(self._backoff)

    def start_connect(self) -> Future[Link] | None:
        """A connect begun on a connector thread, due one ``request_timeout`` from now; None if
        no thread will take it (the interpreter is exiting): the round then connects inline."""
        return _submit(self.connect, time.monotonic() + self._request_timeout)

    def keep_unsent(self, packed: bytes, count: int) -> None:
        """Keep ``count`` packed commands nobody waits for (releases) that a round could not
        write to this master, and see that they are written on a link of it (see MAX_UNSENT).

        The rule: every new link (connect()) writes the kept commands before anything else, so
        a down master's background retry delivers them the moment it is back; and keeping
        starts a delivery task, at most one at a time per master, off the round's path (so the
        round's time bound holds): it writes them on an idle or fresh link, or connects. Down or
        not: a release made right after a network blip must not wait out the backoff (up to
        BACKOFF_CAP) while the master is back; but a down master is tried at most once per
        BACKOFF_FLOOR since its last failed connect (the task waits out the rest on a timer),
        so releases made against a dead master cost a round an append, not a refused connect
        each. Error path only: the usual round keeps nothing and pays nothing for this.
        """
        if self.refusal:
            return  # another master's server: what it would delete is deleted there
        with self._mutex:
            self._unsent.append((packed, count))
            self._unsent_count += count
            while self._unsent_count > MAX_UNSENT and len(self._unsent) > 1:
                self._unsent_count -= self._unsent.pop(0)[1]
            if self._delivering or self._closed:
                return
            self._delivering = True
        self._start_delivery()

    def _start_delivery(self) -> None:
        """Run _deliver (whoever set ``_delivering``): now on a connector thread, or for a
        master that is down, once BACKOFF_FLOOR has passed since its last failed connect."""
        wait = self._failed_at + BACKOFF_FLOOR - time.monotonic() if self._down_until else 0.0
        try:
            if wait <= 0:
                if _submit(self._deliver) is None:  # the interpreter is exiting
                    self._delivering = False
                return
            timer = threading.Timer(wait, _deliver_to_master, args=(weakref.ref(self),))
            timer.name = "redlock-deliver"
            timer.daemon = True
            timer.start()
        except RuntimeError:  # the interpreter is exiting: no thread will run it
            self._delivering = False

    def _deliver(self) -> None:
        """Write the kept commands on a link of this master (a connector thread's task)."""
        link: Link | None = None
        new = False
        if self._closed:  # its Redlock is closed: a new link would outlive it
            with self._mutex:
                self._delivering = False
            return
        try:
            deadline = time.monotonic() + self._request_timeout
            link = self.take_checked()
            if link is None:
                link, new = self.take_fresh(), True
            if link is not None and not self._write_unsent(link, deadline):
                link = None  # closed; the commands are kept again
            if link is None:
                # A new link writes them itself; a failed connect leaves them to the retries.
                link, new = self.connect(deadline), True
        except RedisConnectionError:
            link = None
        except Exception:  # a bug must not lose the task's flag
            logger.exception("delivering kept releases to %s failed", self.name)
            link = None
        finally:
            with self._mutex:
                self._delivering = False
                again = bool(self._unsent) and link is not None and not self._closed
        if link is not None:
            if new:  # not identified by a round yet: the next round does that (see take_fresh)
                self._fresh.append(link)
            else:
                self.give_back(link)
        if again:  # kept while this task was writing
            with self._mutex:
                if self._delivering:
                    return
                self._delivering = True
            self._start_delivery()

    def _write_unsent(self, link: Link, deadline: float) -> bool:
        """Write the kept commands on ``link`` ahead of anything else, owed (not waited for).
        False if the write failed: the link is closed and the commands are kept again."""
        with self._mutex:
            unsent, count = self._unsent, self._unsent_count
            self._unsent, self._unsent_count = [], 0
        if not unsent:
            return True
        try:
            link.send(b"".join(packed for packed, _ in unsent), deadline)
        except _IO_ERRORS:
            link.close()
            with self._mutex:
                self._unsent[:0] = unsent
                self._unsent_count += count
            return False
        link.owed += count
        return True

    def keep_for_later(self, future: Future[Link]) -> None:
        """Done-callback of a connect its round stopped waiting for: the link serves a later one."""
        if future.cancelled() or future.exception() is not None:
            return  # connect() has put the master down
        link = future.result()
        if self.refusal:
            link.close()
        else:
            self._fresh.append(link)

    def connect(self, deadline: float) -> Link:
        """A new link by ``deadline``: connected, authenticated, its database selected and its
        server identified, in one round trip after the TCP (and TLS) handshake.

        Raises ``ConnectionError``, and the master is then down (see :meth:`unavailable`).
        Bounded by ``deadline`` but for name resolution, which has no timeout: it runs on a
        connector thread, off every round's path (inline only once the interpreter is exiting).
        """
        try:
            link = self._open(deadline)
        except (*_IO_ERRORS, RedisError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, wire.ProtocolError):  # what came back is not RESP
                self.refused("is not a Redis server", reason, kind=_NOT_REDIS)
            self._went_down(reason)
            raise RedisConnectionError(reason) from exc
        self.run_id = link.run_id
        self._backoff = 0.0
        self._down_until = 0.0
        # Kept releases go first on every new link: a retry's, a round's, a delivery task's.
        if self._unsent and not self._write_unsent(link, deadline):
            reason = "the link broke while writing kept releases"
            self._went_down(reason)
            raise RedisConnectionError(reason)
        return link

    def _went_down(self, reason: str) -> None:
        self._failed_at = time.monotonic()
        self._backoff = min(BACKOFF_CAP, max(BACKOFF_FLOOR, 2 * self._backoff))
        self._down_reason = f"down: {reason} (retried in the background)"
        self._down_until = time.monotonic() + self._backoff
        self._schedule_retry(self._backoff)  # no-op while a retry is scheduled or under way

    def _open(self, deadline: float) -> Link:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RedisTimeoutError("no time left to connect within request_timeout")
        options = dict(self._options)
        # redis-py's own blocking steps, the TCP connect and the TLS handshake, get what is left.
        options["socket_connect_timeout"] = options["socket_timeout"] = remaining
        conn = self._connection_class(**options)
        try:
            conn.connect()  # resolution, TCP, TLS; _no_handshake stands in for the rest
            link = Link(conn, self)
            commands = self._handshake(conn)
            replies = link.exchange(b"".join(map(wire.pack, commands)), len(commands), deadline)
            for command, reply in zip(commands, replies, strict=True):
                self._check_handshake(command[0], reply)
        except BaseException:
            conn.disconnect()
            raise
        link.run_id = _run_id(replies[-1])
        return link

    @staticmethod
    def _handshake(conn: AbstractConnection) -> list[tuple[Any, ...]]:
        """What a new link sends before anything else, in one write: AUTH, CLIENT SETNAME and
        SELECT as the master's options ask, then ``INFO server`` for the server's run_id."""
        commands: list[tuple[Any, ...]] = []
        if conn.credential_provider is not None or conn.username or conn.password:
            provider = conn.credential_provider or UsernamePasswordCredentialProvider(
                conn.username, conn.password
            )
            commands.append(("AUTH", *provider.get_credentials()))
        if conn.client_name:
            commands.append(("CLIENT", "SETNAME", conn.client_name))
        if conn.db:
            commands.append(("SELECT", conn.db))
        commands.append(("INFO", "server"))
        return commands

    def _check_handshake(self, name: str, reply: Any) -> None:
        if name == "INFO":
            # An INFO refused (renamed, or an ACL user without it) leaves the server unidentified,
            # not unusable; one refused for want of AUTH means every command will be.
            if isinstance(reply, wire.ReplyError) and not reply.startswith("NOAUTH"):
                return
            if isinstance(reply, bytes):
                return
        elif reply == b"OK":
            return
        if isinstance(reply, wire.ReplyError):
            self.refused(f"refused {name} on a new connection", reply)
            raise RedisConnectionError(f"{name} refused: {reply}")
        raise wire.ProtocolError(f"{name} answered {reply!r}")  # an echo server, say

    def give_back(self, link: Link) -> None:
        if not link.late and not self.refusal:  # one attribute read: see refuse()
            self._idle.append(link)
            return
        if self.refusal:
            link.close()
            return
        with self._mutex:
            if link.late:
                self._owing.append(link)
                if len(self._owing) > MAX_OWING_LINKS:
                    self._owing.pop(0).close()
            else:
                self._idle.append(link)

    def refuse(self, reason: str) -> None:
        """This master is another master's server: it never votes again (see Round._identify).
        Its links are closed, and rounds find it with none, so the usual round pays nothing."""
        self.refusal = reason
        self.close()

    def close(self) -> None:
        self._closed = True
        # Every link set parked before now is taken apart by the round that finds it (see
        # LinkSet): it may hold a link of this master, which may now be refused.
        _Generation.value += 1
        with self._mutex:
            links = self._idle + self._owing + self._fresh
            self._idle, self._owing, self._fresh = [], [], []
        for link in links:
            link.close()


def _retry_master(master: weakref.ref[Master]) -> None:
    found = master()
    if found is not None:
        found._retry()


def _deliver_to_master(master: weakref.ref[Master]) -> None:
    found = master()  # held weakly, as by the retry timer
    if found is not None:
        found._deliver()


def _checked(masters: Sequence[Master], links: list[Link | None]) -> list[Link | None]:
    """``links`` (idle, one per master, unchecked) with every link the master closed replaced by
    a checked idle link or None. One ``poll(0)`` for them all: no round trip, and one system call
    per round rather than one per master (see :meth:`Link.settle`)."""
    poller = waiting.poll()
    fds = []
    for link in links:
        if link is None:
            fds.append(-1)
        else:
            poller.register(link.fd, _WATCH)
            fds.append(link.fd)
    events = poller.poll(0)
    if events:
        _settle(masters, links, fds, events)
    return links


def _settle(
    masters: Sequence[Master], links: list[Link | None], fds: list[int], events: list[tuple[int, int]]
) -> None:
    """Replace in ``links`` every link that ``poll`` found closed (``fds[i]`` is link i's)."""
    for fd, event in events:
        i = fds.index(fd)
        link = links[i]
        if link is not None and not link.settle(event):
            link.close()
            links[i] = _pop_usable(masters[i]._idle)


class _Generation:
    """Counts Master.close() calls (a refusal closes its master too): a link set parked before
    the latest one is not trusted whole (see LinkSet)."""

    value = 0


class LinkSet:
    """One idle link per master, as a round that ended cleanly left them, with one ``poll``
    object watching all of them.

    The usual round takes a whole set with one pop and checks it with one ``poll(0)``, where
    taking five links from five idle stacks, registering each with a new poll object and giving
    each back cost a loop over the masters apiece. A set holds only links a master's idle stack
    could hold (none late, none of a refused master), and is trusted whole only in the process
    and the :class:`_Generation` it was parked in: a set from before a fork is dropped (its
    sockets are the parent's), and one from before a master was closed or refused is handed
    back link by link (:meth:`Master.give_back` closes a refused master's).
    """

    __slots__ = ("fds", "generation", "links", "pid", "poller")

    def __init__(self, links: list[Link]) -> None:
        self.generation = _Generation.value  # read before the refusals are looked at: see park
        self.pid = pid()
        self.links = links
        self.fds = [link.fd for link in links]
        self.poller = waiting.poll()
        for fd in self.fds:
            self.poller.register(fd, _WATCH)

    @classmethod
    def park(cls, masters: Sequence[Master], links: list[Link]) -> LinkSet | None:
        """A new set of ``links``, or None if one of ``masters`` is refused (its link must be
        closed, which :meth:`Master.give_back` does)."""
        linkset = cls(links)
        # A refusal sets Master.refusal before it bumps the generation: one that comes after the
        # set read the generation makes the set stale; one before is seen here.
        for master in masters:
            if master.refusal:
                return None
        return linkset

    def trusted(self) -> bool:
        return self.generation == _Generation.value and self.pid == pid()

    def unpark(self, masters: Sequence[Master]) -> None:
        """Take an untrusted set apart: its links go back to their masters one by one, or, in a
        forked child, are dropped unused (never read, never shut down: they are the parent's)."""
        if self.pid != pid():
            return
        for master, link in zip(masters, self.links, strict=True):
            master.give_back(link)


def _pop_usable(stack: list[Link]) -> Link | None:
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


def refuse_shared_servers(masters: Sequence[Master]) -> None:
    """Raise ``ConfigError`` if two masters are one server, which would cast several votes.

    One server is one host and port (whatever names or databases reach it: ``localhost`` and
    ``127.0.0.1``, ``/0`` and ``/1``) or one unix socket (whatever path or symlink leads to it).
    Host names are resolved here, at construction, all at once and for ``RESOLVE_TIMEOUT`` at
    most; a name that does not resolve in time is compared as written (a server reached under
    two unresolved names is then caught at first contact, by its run id).
    """
    endpoints: list[tuple[str, Any]] = []
    for master in masters:
        options = master._options
        if issubclass(master._connection_class, redis.UnixDomainSocketConnection):
            endpoints.append(("unix", os.path.realpath(str(options.get("path")))))
        else:
            endpoints.append((str(options.get("host", "localhost")), int(options.get("port", 6379))))
    seen: dict[tuple[str, Any], Master] = {}
    for master, addresses in zip(masters, _resolve(endpoints), strict=True):
        for address in addresses:
            other = seen.get(address)
            if other is not None and other is not master:
                same = (
                    f"{master.name} is listed more than once"
                    if other.name == master.name
                    else f"{other.name} and {master.name} are one server"
                )
                raise ConfigError(
                    f"masters: {same}; each master must be an independent server, or one server "
                    "would cast several votes"
                )
        for address in addresses:
            seen[address] = master


def _resolve(endpoints: Sequence[tuple[str, Any]]) -> list[set[tuple[str, Any]]]:
    """Each endpoint's addresses: (ip, port) pairs, the unix path, or the name as written."""
    found: list[set[tuple[str, Any]]] = []
    lookups: dict[int, list[str]] = {}  # endpoint index -> the addresses its name resolved to
    for index, (host, port) in enumerate(endpoints):
        ip = _canonical_ip(host) if host != "unix" else None
        found.append({(ip, port)} if ip is not None else {(host.lower(), port)})
        if ip is None and host != "unix":
            lookups[index] = []
    if lookups:
        # getaddrinfo has no timeout of its own: each lookup runs in a daemon thread that is
        # left behind (and cannot hold up exit) if the resolver hangs.
        threads = []
        for index, answers in lookups.items():
            host, port = endpoints[index]
            thread = threading.Thread(
                target=_lookup, args=(host, port, answers), name="redlock-resolve", daemon=True
            )
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + RESOLVE_TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for index, answers in lookups.items():
            found[index] |= {(ip, endpoints[index][1]) for ip in list(answers)}
    return found


def _lookup(host: str, port: int, answers: list[str]) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return  # unresolvable: the name as written is all there is to compare
    answers.extend(ip for ip in (_canonical_ip(str(info[4][0])) for info in infos) if ip is not None)


def _canonical_ip(text: str) -> str | None:
    """One spelling per host address; None if ``text`` is not an IP address."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        # The IPv6 loopback is the same host as the IPv4 one: a server listening on one
        # (Redis's default bind is "127.0.0.1 -::1") is the one listening on the other.
        if ip.is_loopback:
            return "127.0.0.1"
    return str(ip)


_connector: ThreadPoolExecutor | None = None
_connector_mutex = threading.Lock()


def _connector_pool() -> ThreadPoolExecutor:
    """Threads for connecting to several masters at once (only when links must be made)."""
    global _connector
    with _connector_mutex:
        if _connector is None:
            _connector = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redlock-connect")
        return _connector


def _submit(function: Any, *args: Any) -> Future[Any] | None:
    """``function(*args)`` begun on a connector thread; None once the interpreter is exiting:
    concurrent.futures refuses new work from its own exit hook on, which runs before atexit
    handlers (the exit-time flush of lingering releases then connects inline)."""
    try:
        return _connector_pool().submit(function, *args)
    except RuntimeError:
        return None


def _forget_connector_after_fork() -> None:
    global _connector, _connector_mutex
    # The parent's pool threads did not survive the fork: work queued on its executor would
    # never run. A new pool is made on first use.
    _connector = None
    _connector_mutex = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_forget_connector_after_fork)


class _Connecting(NamedTuple):
    """What a round's first command waits for: the connects begun for it, and the carried
    releases (taken out of the round by then) that must go out on the links they make."""

    pending: list[tuple[int, Future[Link] | None]]
    carry: bytes
    carried: int


class Round:
    """One link per master for the span of one lock operation; a context manager.

    ``call`` sends one command per master and waits for the replies; further calls in the same
    round reuse the same links, which is what orders a release after a late acquire.

    ``carry`` are commands for every master whose replies nobody waits for (lingering
    releases): they go out in the same write as the round's first command to each master.
    """

    # Set only by _find_links, when some master had no idle link: the usual round reads these
    # class defaults (one attribute read per command, and one at close).
    _slow = False
    _pending: list[tuple[int, Future[Link] | None]] | None = None
    _refusal = ""

    _unclean = False  # a link went late: the round's links go back one by one (see close)
    # A call under way. Left True only by an exception that cut a call short (a time limit's
    # SoftTimeLimitExceeded, KeyboardInterrupt, a green pool's Timeout, all raised wherever the
    # code happens to be): see close.
    _busy = False

    def __init__(
        self, masters: Sequence[Master], carry: Sequence[Command] = (), sets: list[LinkSet] | None = None
    ) -> None:
        self.masters = masters
        self._carry = b"".join(map(_packed, carry)) if carry else b""
        self._carried = len(carry)
        self._sets = sets
        linkset = None
        if sets:
            try:
                linkset = sets.pop()  # atomic: no mutex
            except IndexError:
                pass  # another thread took the last one
            else:
                if not linkset.trusted():
                    linkset.unpark(masters)
                    linkset = None
        self._linkset = linkset
        links: list[Link | None]
        if linkset is not None:
            links = list(linkset.links)
            events = linkset.poller.poll(0)
            if events:
                _settle(masters, links, linkset.fds, events)
        else:
            links = _checked(masters, [master.take_idle() for master in masters])
        self.links = links
        self.failures: list[str] = [""] * len(masters)
        if None in self.links:
            self._find_links()

    def _find_links(self) -> None:
        """Links for the masters whose idle stack had none (off the usual path): a fresh link if
        one is there, else a connect begun now, which the round's first command waits for by its
        own deadline. A master that is down or refused gets none: its vote is ``error`` at once.
        """
        pending: list[tuple[int, Future[Link] | None]] = []
        for i, master in enumerate(self.masters):
            if self.links[i] is not None:
                continue
            if master.refusal:
                self._refusal = self.failures[i] = master.refusal
                continue
            link = master.take_fresh()
            if link is not None:
                if self._identify(i, link):
                    self.links[i] = link
                continue
            why = master.unavailable()
            if why:
                self.failures[i] = why
            else:
                pending.append((i, master.start_connect()))
        if pending:
            self._pending = pending
        self._slow = bool(pending or self._refusal)

    def _identify(self, i: int, link: Link) -> bool:
        """Whether master i's new link may carry anything: its server is no other master's.

        Two URLs may lead to one server where nothing in them tells (a proxy, a NAT, an alias,
        another database of it); the server's run_id, read in every new link's handshake, does.
        Every new link passes here before its first command, so one server never votes twice.
        """
        run_id = link.run_id
        master = self.masters[i]
        for other in self.masters:
            if run_id and other is not master and other.run_id == run_id:
                reason = (
                    f"masters {other.name} and {master.name} are one server (run_id {run_id}): "
                    "each master must be an independent server, or one server would cast several "
                    "votes; this Redlock grants nothing until it is built with independent masters"
                )
                link.close()
                other.refuse(reason)
                master.refuse(reason)
                self._refusal = self.failures[i] = reason
                return False
        return True

    def _take_pending(self, deadline: float, *, voting: bool) -> _Connecting | None:
        """At the round's first command (slow path): refuse to count votes if a master turned
        out to be another's server, and hand over the connects to finish for this command."""
        self._slow = False
        pending, self._pending = self._pending, None
        if voting and self._refusal:
            self._abandon(pending or [])
            # The lingering releases this round carries still go out, to every other master.
            self._send([None] * len(self.masters), deadline, [_NOT_SENT] * len(self.masters), waited=True)
            raise ConfigError(self._refusal)
        return None if pending is None else _Connecting(pending, self._carry, self._carried)

    def _connected(
        self,
        connecting: _Connecting,
        commands: Sequence[Command | None],
        deadline: float,
        outcomes: list[Outcome],
        *,
        waited: bool,
    ) -> list[int]:
        """Send ``commands[i]``, behind the carried releases, to each master whose connect ends
        by ``deadline``, as soon as it does; the masters a command went to (slow path: their
        replies are read after every other master's, by the same deadline)."""
        sent = []
        tried: set[int] = set()  # got a link in time (a failed write is kept where it fails)
        carry, carried = connecting.carry, connecting.carried
        for i in self._arrivals(connecting.pending, deadline):
            tried.add(i)
            command = commands[i]
            if command is None and not carried:
                continue
            link = self.links[i]
            assert link is not None
            try:
                link.send(carry + _packed(command) if command is not None else carry, deadline)
            except _IO_ERRORS as exc:
                outcome = self._drop(i, exc)
                if command is not None:
                    outcomes[i] = outcome
                self._keep(i, command, carry, carried, waited)
                continue
            link.owed += carried
            if command is not None:
                sent.append(i)
        for i, _ in connecting.pending:
            if self.links[i] is None and i not in tried:
                if commands[i] is not None:
                    outcomes[i] = Outcome("error", detail=self.failures[i] or "no connection")
                # Failed, refused, or still connecting at the deadline (its link, when it comes,
                # is a new link and writes what is kept first).
                self._keep(i, commands[i], carry, carried, waited)
        return sent

    def _arrivals(self, pending: list[tuple[int, Future[Link] | None]], deadline: float) -> Iterator[int]:
        """Each master of ``pending`` as its new link is ready and identified, by ``deadline``.
        A connect still under way then goes on, and its link is kept for a later round."""
        waiting: dict[Future[Link], int] = {}
        try:
            for i, future in pending:
                if future is not None:
                    waiting[future] = i
                    continue
                try:  # no connector thread (the interpreter is exiting): connect here
                    link = self.masters[i].connect(deadline)
                except RedisConnectionError as exc:
                    self.failures[i] = str(exc)
                    continue
                if self._identify(i, link):
                    self.links[i] = link
                    yield i
            while waiting:
                done, _ = wait(waiting, max(0.0, deadline - time.monotonic()), FIRST_COMPLETED)
                if not done:
                    break
                for future in done:
                    i = waiting.pop(future)
                    try:
                        link = future.result()
                    except Exception as exc:  # ConnectionError; anything else is a bug, and no link
                        self.failures[i] = str(exc) or type(exc).__name__
                        continue
                    if self._identify(i, link):
                        self.links[i] = link
                        yield i
        finally:
            for i in waiting.values():
                self.failures[i] = "not connected within request_timeout (still trying, for later rounds)"
            self._abandon([(i, future) for future, i in waiting.items()])

    def _abandon(self, pending: list[tuple[int, Future[Link] | None]]) -> None:
        for i, future in pending:
            if future is not None:
                future.add_done_callback(self.masters[i].keep_for_later)

    def _refused(self) -> Outcome:
        """Every outcome of a call that found two masters to be one server: none of it counts."""
        return Outcome("error", detail=self._refusal)

    def _drop(self, index: int, exc: BaseException) -> Outcome:
        link = self.links[index]
        if link is not None:
            link.close()
        self.links[index] = None
        self.failures[index] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, wire.ProtocolError):  # what came back is not RESP at all
            self.masters[index].refused("is not a Redis server", self.failures[index], kind=_NOT_REDIS)
        return Outcome("error", detail=self.failures[index])

    def call(self, commands: Sequence[Command | None], timeout: float) -> list[Outcome]:
        """Send ``commands[i]`` to master i (None: skip it) and read the replies by one deadline.

        A link with a late reply gets the command too, queued behind the late one, but is not
        waited for again: its outcome is ``timeout``.
        """
        deadline = time.monotonic() + timeout
        # The bound: all this call does ends by ``deadline``, connects included. Connects (and
        # name resolution, which has no timeout) run on connector threads and are waited for
        # until then at most; everything else here is non-blocking or waits on a link's poll.
        self._busy = True  # until the last reply is read: see close
        connecting = self._take_pending(deadline, voting=True) if self._slow else None
        outcomes: list[Outcome] = [_NOT_SENT] * len(commands)
        waiting: list[int] = []
        for i, link in self._send(commands, deadline, outcomes, waited=True, connecting=connecting):
            if link.late:
                link.owed += 1
                outcomes[i] = _QUEUED_BEHIND_LATE
            else:
                waiting.append(i)
        # The replies are taken in order, waiting only on the link at hand: while we sleep on
        # one master, the others' replies pile up in their sockets and are then read without
        # waiting. A round usually sleeps once or twice, where a poll over every link would
        # wake for each reply as it lands. A master that does not answer costs the remaining
        # time once; every link after it is read without waiting.
        for position, i in enumerate(waiting):
            # The first master has had no time to answer yet: wait before the first read.
            outcomes[i] = self._await(i, commands[i], deadline, read_first=position > 0)
        if connecting is not None:
            for i in self._connected(connecting, commands, deadline, outcomes, waited=True):
                outcomes[i] = self._await(i, commands[i], deadline, read_first=False)
            if self._refusal:
                self._busy = False
                return [self._refused()] * len(outcomes)
        self._busy = False
        return outcomes

    def call_many(self, batches: Sequence[Sequence[Command]], timeout: float) -> list[list[Outcome]]:
        """Send every command of ``batches[i]`` to master i in one write (pipelined), then read
        their replies in order, all by one deadline: ``[i][j]`` is the outcome of master i's j-th.

        A batch of n commands costs each master one round trip, not n. The general form of
        :meth:`call` (which is this with one command each, kept apart as the usual round's fast
        path). A master whose j-th reply misses the deadline owes it and every later one (late),
        and their outcomes are ``timeout``; an empty batch skips that master.
        """
        deadline = time.monotonic() + timeout
        self._busy = True  # until the last reply is read: see close
        connecting = self._take_pending(deadline, voting=True) if self._slow else None
        # A batch's commands go out as one piece of bytes, packed once however many masters
        # share the batch (the heartbeat sends every master the same one).
        joined: list[Command | None] = []
        last: Sequence[Command] | None = None
        packed: bytes | None = None
        for batch in batches:
            if batch is not last:
                packed = b"".join(map(_packed, batch)) if batch else None
                last = batch
            joined.append(packed)
        firsts: list[Outcome] = [_NOT_SENT] * len(batches)
        sent = self._send(joined, deadline, firsts, waited=True, connecting=connecting)
        # Not sent (no link, or the write failed): every command of the batch shares that error.
        results = [[firsts[i]] * len(batch) for i, batch in enumerate(batches)]
        waiting: list[int] = []
        for i, link in sent:
            # _send counted one owed reply per "command"; a batch owes one per command in it.
            if link.late:
                link.owed += len(batches[i])
                results[i] = [_QUEUED_BEHIND_LATE] * len(batches[i])
            else:
                waiting.append(i)
        for position, i in enumerate(waiting):
            results[i] = self._await_batch(i, batches[i], deadline, read_first=position > 0)
        if connecting is not None:
            for i in self._connected(connecting, joined, deadline, firsts, waited=True):
                results[i] = self._await_batch(i, batches[i], deadline, read_first=False)
            for i, _ in connecting.pending:
                if self.links[i] is None:
                    results[i] = [firsts[i]] * len(batches[i])
            if self._refusal:
                self._busy = False
                return [[self._refused()] * len(batch) for batch in batches]
        self._busy = False
        return results

    def send(self, commands: Sequence[Command | None], timeout: float) -> None:
        """Send ``commands[i]`` to master i and do not wait: each link owes the reply.

        For a release: the master applies it on arrival, and the link's next use skips the reply.
        """
        deadline = time.monotonic() + timeout
        self._busy = True  # until every link has counted what it owes: see close
        connecting = self._take_pending(deadline, voting=False) if self._slow else None
        outcomes: list[Outcome] = [_NOT_SENT] * len(commands)
        for _, link in self._send(commands, deadline, outcomes, waited=False, connecting=connecting):
            link.owed += 1
        if connecting is not None:
            for i in self._connected(connecting, commands, deadline, outcomes, waited=False):
                new_link = self.links[i]
                assert new_link is not None
                new_link.owed += 1
        self._busy = False

    def _send(
        self,
        commands: Sequence[Command | None],
        deadline: float,
        outcomes: list[Outcome],
        *,
        waited: bool,
        connecting: _Connecting | None = None,
    ) -> list[tuple[int, Link]]:
        """Write ``commands[i]`` (behind the carried releases) on master i's link; the masters
        it went to. ``waited``: the caller reads the replies (a vote), else nobody does (a
        release). Masters whose connect is under way (``connecting``) are left to _connected."""
        sent = []
        carry, carried = self._carry, self._carried
        if carried:
            self._carry, self._carried = b"", 0
        links = self.links
        # The same command object goes to every master: pack it once, not once per master.
        last: Command | None = None
        packed = carry
        for i, command in enumerate(commands):
            if command is None and not carried:
                continue
            link = links[i]
            if link is None:
                if connecting is not None and any(i == j for j, _ in connecting.pending):
                    continue
                if command is not None:
                    outcomes[i] = Outcome("error", detail=self.failures[i] or "no connection")
                self._keep(i, command, carry, carried, waited)
                continue
            if command is not last:
                packed = carry + _packed(command) if command is not None else carry
                last = command
            try:
                link.send(packed, deadline)
            except _IO_ERRORS as exc:
                if command is not None:
                    outcomes[i] = self._drop(i, exc)
                else:
                    self._drop(i, exc)
                self._keep(i, command, carry, carried, waited)
                continue
            if carried:
                link.owed += carried
            if command is not None:
                sent.append((i, link))
        return sent

    def _keep(self, i: int, command: Command | None, carry: bytes, carried: int, waited: bool) -> None:
        """What nobody waits for, of what could not be written to master i, is kept on the
        master and written on its next link (see MAX_UNSENT): never dropped. A command someone
        waits for (a vote) is not: its round has counted it as an error already."""
        if waited or command is None:
            if carried:
                self.masters[i].keep_unsent(carry, carried)
        else:
            self.masters[i].keep_unsent(carry + _packed(command), carried + 1)

    def _await(self, i: int, command: Command | None, deadline: float, read_first: bool) -> Outcome:
        """Master i's next own reply, waited for until ``deadline`` (reading first if
        ``read_first``). A reply that does not come in time is owed, and the link is late."""
        link = self.links[i]
        assert link is not None
        outcome = self._read(i, command) if read_first else None
        while outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not link.poller.poll(remaining * 1000):
                outcome = self._read(i, command)  # it may have arrived as the time ran out
                if outcome is None:
                    link.owed += 1
                    link.late = True
                    self._unclean = True
                    return _LATE
                return outcome
            outcome = self._read(i, command)
        return outcome

    def _await_batch(
        self, i: int, batch: Sequence[Command], deadline: float, read_first: bool
    ) -> list[Outcome]:
        """Master i's replies to ``batch``, in order, by ``deadline`` (see :meth:`call_many`)."""
        outcomes: list[Outcome] = []
        for j, command in enumerate(batch):
            # After the first reply the rest have usually arrived with it: read before waiting.
            outcome = self._await(i, command, deadline, read_first=read_first or j > 0)
            outcomes.append(outcome)
            rest = len(batch) - j - 1
            if rest and outcome is _LATE:
                link = self.links[i]
                assert link is not None
                link.owed += rest  # every later reply is behind the late one
                outcomes += [_LATE] * rest
                break
            if rest and self.links[i] is None:  # the link was dropped: nothing more will come
                outcomes += [outcome] * rest
                break
        return outcomes

    def _read(self, i: int, command: Command | None) -> Outcome | None:
        """Master i's next own reply if it has arrived in full (None: not yet)."""
        link = self.links[i]
        assert link is not None
        try:
            reply = link.read_reply()
        except _IO_ERRORS as exc:
            return self._drop(i, exc)
        if reply is wire.NOTHING:
            return None  # part of a reply, or only owed ones
        outcome = _COMMON_OK.get(reply) if type(reply) is not list else None
        return outcome if outcome is not None else self._uncommon(i, reply, command)

    def _uncommon(self, i: int, reply: Any, command: Command | None) -> Outcome:
        """The outcome of a reply that is not one of the usual few (off the usual path)."""
        if isinstance(reply, wire.ReplyError) and reply.startswith(NOSCRIPT):
            return Outcome("error", detail=f"ResponseError: {reply}")  # the caller sends the source
        if isinstance(reply, wire.ReplyError):
            # No lock command fails on a master that serves us; one that does (NOPERM, READONLY,
            # OOM, MOVED, CLUSTERDOWN, ...) would otherwise only show as a vote that never
            # comes, so it is reported (rate-limited by Master.refused).
            self.masters[i].refused("refused a command", reply)
            return Outcome("error", detail=f"ResponseError: {reply}")
        if type(reply) is list and command is not None and _is_echo(reply, command):
            # An echo server "answers" each command with itself, which parses as an array.
            detail = "sent our command back as its reply"
            self.masters[i].refused("is not a Redis server", detail, kind=_NOT_REDIS)
            return Outcome("error", detail=detail)
        return Outcome("ok", reply)

    def close(self) -> None:
        if self._pending is not None:  # connects no command waited for: for later rounds
            self._abandon(self._pending)
            self._pending = None
        links, self.links = self.links, [None] * len(self.masters)
        if self._busy:
            # INVARIANT: a link carries the next command only if what it owes is exactly known.
            # A call cut short by an exception leaves links whose replies were sent for and not
            # read, or written and not yet counted as owed: reused, the next round would take an
            # old "+OK" for its own grant. They are closed. (A command the master had not read
            # yet may be lost with them: a SET, which grants nothing then, or a release, whose
            # key then expires with its TTL.)
            for link in links:
                if link is not None:
                    link.close()
            return
        sets = self._sets
        if sets is not None and not self._unclean and not self._refusal and None not in links:
            # The usual round: its links go back as one set, the same set object if the round
            # took one and kept every link of it.
            linkset = self._linkset
            if linkset is None or linkset.links != links:
                linkset = LinkSet.park(self.masters, links)  # type: ignore[arg-type]
            if linkset is not None:
                sets.append(linkset)
                return
        for master, link in zip(self.masters, links, strict=True):
            if link is None:
                continue
            if link.late or master.refusal:
                master.give_back(link)
            else:
                master._idle.append(link)  # give_back's usual case, inlined: one per master per round

    def __enter__(self) -> Round:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def script_template(script: scripts.Script, keys: int, args: int) -> wire.Template:
    """``EVAL`` of ``script`` with its source packed once: ``.pack(*keys, *args)`` per call."""
    return wire.Template(("EVAL", script.source, keys, *[wire.SLOT] * (keys + args)))


def script_sha_template(script: scripts.Script, keys: int, args: int) -> wire.Template:
    """``EVALSHA`` of ``script``; a master that does not have it answers NOSCRIPT and runs
    nothing, so the caller may send the ``EVAL`` form to it instead (see fencing.py)."""
    return wire.Template(("EVALSHA", script.sha1, keys, *[wire.SLOT] * (keys + args)))
