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

Links are made by redis-py (TLS, AUTH, ACL users, SELECT) and then driven here, non-blocking,
through :mod:`.wire`: one ``send`` per master, one ``poll`` for all of them, one ``recv`` per
reply, and nothing hidden in between.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import scripts, wire
from .errors import ConfigError

logger = logging.getLogger("celery_redlock.masters")

# A command as its arguments, or already packed (bytes) by a wire.Template.
Command = tuple[Any, ...] | bytes
_IO_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, wire.ProtocolError)
_NOT_READY = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
RECV_SIZE = 65536

# A master whose connection attempt *timed out* is not tried again for this long, so a
# black-holed or paused master costs one request_timeout per interval rather than one per
# operation. A refused connection costs microseconds and is simply tried again next time, so a
# restarted master rejoins at once.
RECONNECT_INTERVAL = 0.5
# Links to a master that stopped answering pile up while each one waits for its late replies;
# past this many, the oldest is closed.
MAX_OWING_LINKS = 16


@dataclass(frozen=True)
class Outcome:
    """One master's answer to one command: a reply, an error, or no answer in time."""

    kind: Literal["ok", "error", "timeout"]
    value: Any = None
    detail: str = ""


# os.getpid() is a system call; taking and giving back links would make ten of them per round.
# The pid is read once here and again in each forked child.
_pid = os.getpid()


def _note_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_note_fork)

_NOT_SENT = Outcome("error", detail="not sent")
# Lock commands answer with one of a handful of values; their outcomes are shared, not rebuilt
# once per master per round (Outcome is immutable).
_COMMON_OK = {value: Outcome("ok", value) for value in (b"OK", 1, 0, None)}
# The outcome of a granted SET, shared by every master that granted one.
GRANTED = _COMMON_OK[b"OK"]


def _packed(command: Command) -> bytes:
    return command if type(command) is bytes else wire.pack(command)


class Link:
    """One connection to one master, the replies it still owes us, and whether one is late.

    Owed replies belong to commands whose answer nobody waits for: a release (owed on time) or
    a command whose reply missed its deadline (late). They are read and skipped, in order,
    before the reply of the next command on this link.
    """

    __slots__ = ("conn", "late", "owed", "poller", "reader", "sock", "tls")
    conn: redis.Connection
    sock: socket.socket
    poller: select.poll
    reader: wire.Reader
    owed: int
    late: bool
    tls: bool

    def __init__(self, conn: redis.Connection) -> None:
        self.conn = conn
        sock = conn._sock  # redis-py has no public accessor for it
        assert sock is not None
        # Non-blocking: our poll decides when to read, so no call here can wait on its own.
        sock.settimeout(0.0)
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.poller = select.poll()  # this socket alone, for waiting on its reply
        self.poller.register(sock.fileno(), select.POLLIN)
        self.reader = wire.Reader()
        self.owed = 0
        self.late = False

    def send(self, packed: bytes, deadline: float) -> None:
        try:
            sent = self.sock.send(packed)
        except _NOT_READY:
            sent = 0
        if sent < len(packed):
            self._send_rest(memoryview(packed)[sent:], deadline)

    def _send_rest(self, data: memoryview, deadline: float) -> None:
        # Only when the socket buffer is full, i.e. the master has stopped reading.
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLOUT)
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise RedisTimeoutError("the master stopped reading; command not sent in time")
            try:
                data = data[self.sock.send(data):]
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
        if self.tls or reader.buffered():
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
                logger.debug("a command nobody waited for failed: %s", skipped)
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
    )
    # redis-py 8 turns on "maintenance notifications" for URLs, which it refuses to run on a
    # RESP2 connection without hiredis; they are push messages we would not read anyway.
    options.pop("maint_notifications_config", None)
    options.pop("maint_notifications_pool_handler", None)
    if issubclass(connection_class, redis.UnixDomainSocketConnection):
        options.pop("socket_keepalive", None)
    return options


def describe(connection_class: type[redis.Connection], kwargs: dict[str, Any]) -> str:
    """How a master is named in messages: host:port, or its socket path (plus a non-zero db)."""
    if issubclass(connection_class, redis.UnixDomainSocketConnection):
        name = str(kwargs.get("path"))
    else:
        name = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    db = int(kwargs.get("db") or 0)
    return f"{name}/{db}" if db else name


class Master:
    """One independent Redis master: its name, its options, and a small stack of idle links."""

    def __init__(
        self, name: str, connection_class: type[redis.Connection], kwargs: dict[str, Any],
        request_timeout: float,
    ) -> None:
        self.name = name
        self._connection_class = connection_class
        self._options = _connection_options(connection_class, kwargs, request_timeout)
        self._idle: list[Link] = []
        self._owing: list[Link] = []
        self._mutex = threading.Lock()
        self._pid = _pid
        self._down_until = 0.0
        self._down_reason = ""

    @classmethod
    def from_spec(cls, spec: object, request_timeout: float) -> Master:
        """A master from a redis URL or a ``redis.Redis`` client (only its options are used)."""
        if isinstance(spec, redis.Redis):
            pool = spec.connection_pool
            connection_class = pool.connection_class
            kwargs = dict(pool.connection_kwargs)
        elif isinstance(spec, str):
            scheme = urlparse(spec).scheme
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
        else:
            raise ConfigError(
                f"masters: expected a redis URL or a redis.Redis client, got {type(spec).__name__}"
            )
        return cls(describe(connection_class, kwargs), connection_class, kwargs, request_timeout)

    def _after_fork(self) -> None:
        # The parent's sockets are not ours to use; redis-py's disconnect() in a child only
        # closes the descriptor and leaves the parent's connection alone.
        if self._pid != _pid:
            with self._mutex:
                if self._pid != _pid:
                    self._idle.clear()
                    self._owing.clear()
                    self._pid = _pid
                    self._down_until = 0.0

    def take_idle(self) -> Link | None:
        """An idle link with no late reply, if one is ready (it may owe replies on time)."""
        if self._pid != _pid:
            self._after_fork()
        if not self._owing:
            # list.pop is atomic: the common case needs no mutex.
            try:
                return self._idle.pop()
            except IndexError:
                return None
        with self._mutex:
            if self._owing:
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
            return self._idle.pop() if self._idle else None

    def connect(self) -> Link:
        """A new link (connected, authenticated); raises ``ConnectionError`` if it cannot be."""
        now = time.monotonic()
        if now < self._down_until:
            raise RedisConnectionError(f"not retried until the last failure cools down: "
                                       f"{self._down_reason}")
        conn = self._connection_class(**self._options)
        try:
            conn.connect()
        except (*_IO_ERRORS, ResponseError) as exc:
            conn.disconnect()
            reason = f"{type(exc).__name__}: {exc}"
            if time.monotonic() - now >= self._options["socket_connect_timeout"] / 2:
                self._down_until = time.monotonic() + RECONNECT_INTERVAL
                self._down_reason = reason
            raise RedisConnectionError(reason) from exc
        return Link(conn)

    def give_back(self, link: Link) -> None:
        if self._pid != _pid:
            return
        if not link.late:
            self._idle.append(link)
            return
        with self._mutex:
            if link.late:
                self._owing.append(link)
                if len(self._owing) > MAX_OWING_LINKS:
                    self._owing.pop(0).close()
            else:
                self._idle.append(link)

    def close(self) -> None:
        with self._mutex:
            links, self._idle, self._owing = self._idle + self._owing, [], []
        for link in links:
            link.close()


_connector: ThreadPoolExecutor | None = None
_connector_pid = 0
_connector_mutex = threading.Lock()


def _connector_pool() -> ThreadPoolExecutor:
    """Threads for connecting to several masters at once (only when links must be made)."""
    global _connector, _connector_pid
    with _connector_mutex:
        if _connector is None or _connector_pid != os.getpid():
            _connector = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redlock-connect")
            _connector_pid = os.getpid()
        return _connector


class Round:
    """One link per master for the span of one lock operation; a context manager.

    ``call`` sends one command per master and waits for the replies; further calls in the same
    round reuse the same links, which is what orders a release after a late acquire.

    ``carry`` are commands for every master whose replies nobody waits for (lingering
    releases): they go out in the same write as the round's first command to each master.
    """

    def __init__(self, masters: Sequence[Master], carry: Sequence[Command] = ()) -> None:
        self.masters = masters
        self._carry = b"".join(map(_packed, carry)) if carry else b""
        self._carried = len(carry)
        self.links: list[Link | None] = [master.take_idle() for master in masters]
        self.failures: list[str] = [""] * len(masters)
        if None in self.links:
            missing = [i for i, link in enumerate(self.links) if link is None]
            if len(missing) == 1:
                self._connect(missing[0])
            else:
                list(_connector_pool().map(self._connect, missing))

    def _connect(self, index: int) -> None:
        try:
            self.links[index] = self.masters[index].connect()
        except RedisConnectionError as exc:
            self.failures[index] = str(exc)

    def _drop(self, index: int, exc: BaseException) -> Outcome:
        link = self.links[index]
        if link is not None:
            link.close()
        self.links[index] = None
        self.failures[index] = f"{type(exc).__name__}: {exc}"
        return Outcome("error", detail=self.failures[index])

    def call(self, commands: Sequence[Command | None], timeout: float) -> list[Outcome]:
        """Send ``commands[i]`` to master i (None: skip it) and read the replies by one deadline.

        A link with a late reply gets the command too, queued behind the late one, but is not
        waited for again: its outcome is ``timeout``.
        """
        deadline = time.monotonic() + timeout
        outcomes: list[Outcome] = [_NOT_SENT] * len(commands)
        waiting: list[int] = []
        for i, link in self._send(commands, deadline, outcomes):
            if link.late:
                link.owed += 1
                outcomes[i] = Outcome("timeout", detail="queued behind a reply that is late")
            else:
                waiting.append(i)
        if waiting:
            self._collect(waiting, deadline, outcomes)
        return outcomes

    def send(self, commands: Sequence[Command | None], timeout: float) -> None:
        """Send ``commands[i]`` to master i and do not wait: each link owes the reply.

        For a release: the master applies it on arrival, and the link's next use skips the reply.
        """
        outcomes: list[Outcome] = [_NOT_SENT] * len(commands)
        for _, link in self._send(commands, time.monotonic() + timeout, outcomes):
            link.owed += 1

    def _send(self, commands: Sequence[Command | None], deadline: float,
              outcomes: list[Outcome]) -> list[tuple[int, Link]]:
        sent = []
        carry, carried = self._carry, self._carried
        self._carry, self._carried = b"", 0
        # The same command object goes to every master: pack it once, not once per master.
        last: Command | None = None
        packed = carry
        for i, command in enumerate(commands):
            if command is None and not carried:
                continue
            link = self.links[i]
            if link is None:
                if command is not None:
                    outcomes[i] = Outcome("error", detail=self.failures[i] or "no connection")
                continue
            try:
                if command is not last:
                    packed = carry + _packed(command) if command is not None else carry
                    last = command
                if link.owed and not link.late:
                    # Owed replies that are already here are read now, so that the poll below
                    # does not wake for them.
                    link.fill()
                link.send(packed, deadline)
            except _IO_ERRORS as exc:
                if command is not None:
                    outcomes[i] = self._drop(i, exc)
                else:
                    self._drop(i, exc)
                continue
            link.owed += carried
            if command is not None:
                sent.append((i, link))
        return sent

    def _collect(self, waiting: list[int], deadline: float, outcomes: list[Outcome]) -> None:
        # The replies are taken in order, waiting only on the link at hand: while we sleep on
        # one master, the others' replies pile up in their sockets and are then read without
        # waiting. A round usually sleeps once or twice, where a poll over every link would
        # wake for each reply as it lands. A master that does not answer costs the remaining
        # time once; every link after it is read without waiting.
        for position, i in enumerate(waiting):
            link = self.links[i]
            assert link is not None
            # The first master has had no time to answer yet: wait before the first read.
            ready = position > 0
            while not (ready and self._read(i, outcomes)):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not link.poller.poll(remaining * 1000):
                    if ready and self._read(i, outcomes):
                        break  # arrived as the time ran out
                    link.owed += 1
                    link.late = True
                    outcomes[i] = Outcome("timeout", detail="no reply within request_timeout")
                    break
                ready = True

    def _read(self, i: int, outcomes: list[Outcome]) -> bool:
        """Take master i's reply if it has arrived in full; True once ``outcomes[i]`` is set."""
        link = self.links[i]
        assert link is not None
        try:
            reply = link.read_reply()
        except _IO_ERRORS as exc:
            outcomes[i] = self._drop(i, exc)
            return True
        if reply is wire.NOTHING:
            return False  # part of a reply, or only owed ones
        if type(reply) is not list and reply in _COMMON_OK:
            outcomes[i] = _COMMON_OK[reply]
        elif isinstance(reply, wire.ReplyError):
            outcomes[i] = Outcome("error", detail=f"ResponseError: {reply}")
        else:
            outcomes[i] = Outcome("ok", reply)
        return True

    def close(self) -> None:
        for master, link in zip(self.masters, self.links, strict=True):
            if link is not None:
                master.give_back(link)
        self.links = [None] * len(self.masters)

    def __enter__(self) -> Round:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def script_template(script: scripts.Script, keys: int, args: int) -> wire.Template:
    """``EVAL`` of ``script`` with its source packed once: ``.pack(*keys, *args)`` per call."""
    return wire.Template(("EVAL", script.source, keys, *[wire.SLOT] * (keys + args)))
