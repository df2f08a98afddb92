"""One master: its idle links, its connects and their backoff, and the commands kept for it."""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlparse

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

from ..._fork import on_fork_in_child
from ...errors import ConfigError
from .. import wire
from .commands import script_loads
from .handshake import (
    FAILOVER,
    NOT_REDIS,
    Silent,
    Unfit,
    accept,
    connection_options,
    describe,
    handshake_commands,
)
from .link import IO_ERRORS, Generation, Link, pop_usable
from .threads import spawn

logger = logging.getLogger("celery_redlock.masters")

# A master whose connect failed is down: no round waits for it, and its connect is retried on a
# timer thread, BACKOFF_FLOOR after the failure and then twice as long after each failure, up to
# BACKOFF_CAP. A dead master costs a round nothing (and the process one connect attempt per
# BACKOFF_CAP); a restarted one is back within BACKOFF_CAP plus one connect.
BACKOFF_FLOOR = 0.05
BACKOFF_CAP = 1.0
# What a failure's reason adds for a process that goes on: the connect is retried, and one a
# round stopped waiting for may still serve a later round. A one-shot command (the operators'
# CLI) ends before either happens, and leaves these out of what it prints.
RETRIED = " (retried in the background)"
STILL_TRYING = " (still trying, for later rounds)"
# A round that finds no idle link for a master begins a connect of its own, however many are
# under way already (others' connects serve their own rounds): a burst of rounds on a healthy
# master must never vote error, or send its releases nowhere, for want of a link. Unless one is
# past its deadline (it hangs: so would the next), or this many are under way (see Master.hung).
MAX_CONNECTS = 32
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
        self._options = connection_options(connection_class, kwargs, request_timeout)
        self._request_timeout = request_timeout
        self._idle: list[Link] = []
        self._owing: list[Link] = []
        self._fresh: list[Link] = []  # connected off a round's path; identified by the next round
        self._mutex = threading.Lock()
        self.run_id = ""  # its server's, as the last new link found it ("" until known)
        self.refusal = ""  # why it may never vote (it is another master's server), or ""
        self.unfit = ""  # why it alone may never vote (no Redis master of its own), or ""
        self._connecting: list[float] = []  # the deadlines of the connects under way
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
                raise ConfigError(f"masters: {spec!r} is a Sentinel-managed client; {FAILOVER}")
            kwargs = dict(pool.connection_kwargs)
        elif isinstance(spec, str):
            scheme = urlparse(spec).scheme
            if "sentinel" in scheme:
                raise ConfigError(f"masters: {spec!r} is a Sentinel URL; {FAILOVER}")
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
            raise ConfigError(f"masters: {spec!r} is a Sentinel client; {FAILOVER}")
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

    def probe_connection(self, timeout: float) -> redis.Connection:
        """A new redis-py connection to this master, outside every round and pool, with
        ``timeout`` for connect and reads (a start-up probe; see :mod:`.probe`)."""
        options = dict(self._options, socket_timeout=timeout, socket_connect_timeout=timeout)
        options.pop("redis_connect_func", None)  # the probe's PING is its own handshake
        conn: redis.Connection = self._connection_class(**options)
        return conn

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
        self._connecting = []
        self._down_until = 0.0
        self._backoff = 0.0
        self._retrying = False
        # The parent's kept releases are the parent's to send.
        self._unsent = []
        self._unsent_count = 0
        self._delivering = False

    def take_idle(self) -> Link | None:
        """An idle link with no late reply (it may owe replies on time), if one is ready,
        *unchecked*: whether the master closed it is for the caller to ask (see :func:`checked`)."""
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
        return pop_usable(self._idle)

    def _drain_owing(self) -> None:
        with self._mutex:
            still_owing = []
            for link in self._owing:
                try:
                    if link.drain():
                        self._idle.append(link)
                        continue
                except IO_ERRORS:
                    link.close()
                    continue
                still_owing.append(link)
            self._owing = still_owing

    def take_fresh(self) -> Link | None:
        """A link connected off a round's path (a retry, or a connect its round gave up on)."""
        return pop_usable(self._fresh)

    def unavailable(self) -> str:
        """Why no round should wait for a new link to this master now, or "" (it may).

        Unfit: refused for good. Down: the last connect failed; the retries go on on a timer
        thread, and the link of the first that succeeds is fresh for the next round. Connecting:
        see :meth:`hung`. The round votes ``error`` at once. Asked only when the master had no
        link for a round (off the usual path).
        """
        if self.unfit:
            return self.unfit
        down_until = self._down_until
        if down_until:
            if not self._retrying:  # stopped by close(), or lost in a fork: resume them
                self._closed = False
                self._schedule_retry(down_until - time.monotonic())
            return self._down_reason
        return self.hung()

    def hung(self) -> str:
        """Why no new connect may begin now, or "": one under way is past its deadline (a name
        lookup or a TCP/TLS handshake that hangs: another would hang too), or MAX_CONNECTS are
        under way. A thread per connect makes this the only bound on what a hung master holds."""
        connecting = self._connecting
        if not connecting:
            return ""
        overdue = time.monotonic() - min(connecting, default=math.inf)
        if overdue > 0:
            return (
                f"connecting: a connect is {overdue + self._request_timeout:.1f} s under way (name "
                "lookup, TCP or TLS handshake); none other begins until it ends"
            )
        if len(connecting) >= MAX_CONNECTS:
            return f"connecting: {len(connecting)} connects under way"
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
        timer.name = f"redlock-reconnect {self.name}"  # which master, for whoever lists threads
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
            self._keep_fresh(link)
        with self._mutex:
            self._retrying = False
        if link is None:
            self._schedule_retry(self._backoff)

    def start_connect(self) -> Future[Link] | None:
        """A connect begun on a thread of its own, due one ``request_timeout`` from now; None if
        no thread can be started (the interpreter is exiting): the round then connects inline."""
        return spawn(self.connect, time.monotonic() + self._request_timeout)

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
        if self.refusal or self.unfit:
            return  # another master's server (what it would delete is deleted there), or unfit
        with self._mutex:
            self._unsent.append((packed, count))
            self._unsent_count += count
            while self._unsent_count > MAX_UNSENT and len(self._unsent) > 1:
                self._unsent_count -= self._unsent.pop(0)[1]
            # INVARIANT: a round that keeps a command needs the master, so it resumes what
            # close() stopped (as unavailable() does): a Redlock stays usable after close(), and
            # a release made then must not wait for a later round that may never come.
            self._closed = False
            if self._delivering:
                return
            self._delivering = True
        self._start_delivery()

    def _start_delivery(self) -> None:
        """Run _deliver (whoever set ``_delivering``): now on a connector thread, or for a
        master that is down, once BACKOFF_FLOOR has passed since its last failed connect."""
        wait = self._failed_at + BACKOFF_FLOOR - time.monotonic() if self._down_until else 0.0
        try:
            if wait <= 0:
                if spawn(self._deliver) is None:  # the interpreter is exiting
                    self._delivering = False
                return
            timer = threading.Timer(wait, _deliver_to_master, args=(weakref.ref(self),))
            timer.name = f"redlock-deliver {self.name}"
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
            if link is None and not self.hung():
                # A new link writes them itself; a failed connect leaves them to the retries,
                # and a hung one (never joined by a second) to its own link, should it come.
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
                self._keep_fresh(link)
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
        except IO_ERRORS:
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
        self._keep_fresh(future.result())

    def _keep_fresh(self, link: Link) -> None:
        """Keep a link connected off a round's path (a retry's, a delivery task's, a connect its
        round stopped waiting for) for the next round.

        INVARIANT (close() leaves no connection open): a link whose connect ended after close()
        (or after the master was refused) is closed here, since close() has already taken apart
        what it found and nothing else would close this one: under load a round's slow connect
        ended after its Redlock was closed and the socket stayed open for good. Checked under
        the mutex that close() takes its links under."""
        with self._mutex:
            if not (self._closed or self.refusal):
                self._fresh.append(link)
                return
        link.close()

    def connect(self, deadline: float) -> Link:
        """A new link by ``deadline``: connected, authenticated, its database selected, its
        server identified and every script loaded, in one round trip after the TCP (and TLS)
        handshake.

        Raises ``ConnectionError``, and the master is then down or unfit (see :meth:`unavailable`).
        Bounded by ``deadline`` but for name resolution, which has no timeout: it runs on a
        thread of its own, off every round's path (inline only once the interpreter is exiting).
        """
        self._connecting.append(deadline)  # list operations are atomic: no mutex
        try:
            link = self._open(deadline)
        except (*IO_ERRORS, RedisError, UnicodeError) as exc:  # UnicodeError: a name IDNA refuses
            raise RedisConnectionError(self._connect_failed(exc)) from exc
        finally:
            with contextlib.suppress(ValueError):  # emptied by a fork meanwhile
                self._connecting.remove(deadline)
        self.run_id = link.run_id
        self._backoff = 0.0
        self._down_until = 0.0
        # Kept releases go first on every new link: a retry's, a round's, a delivery task's.
        if self._unsent and not self._write_unsent(link, deadline):
            reason = "the link broke while writing kept releases"
            self._went_down(reason)
            raise RedisConnectionError(reason)
        return link

    def _connect_failed(self, exc: BaseException) -> str:
        """Why a connect failed, as the rounds will tell it. A server that is no Redis master of
        its own is unfit for good; any other failure puts the master down (retried), and is
        reported when it says something about the server (silent, a name that does not resolve)
        rather than about the moment (refused: a restart; a TCP timeout: a blip)."""
        if isinstance(exc, (Unfit, wire.ProtocolError)):
            what = str(exc) if isinstance(exc, Unfit) else f"not a Redis server: {exc}"
            self.unfit = f"refused: {what}"
            self.refused("is refused for the life of this Redlock", what, kind=NOT_REDIS)
            return self.unfit
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, Silent):
            reason = str(exc)
            self.refused("is silent", reason, kind="silent")
        elif isinstance(exc, UnicodeError) or isinstance(exc.__context__, socket.gaierror):
            host = self._options.get("host")
            reason = f"its host name {host} does not resolve ({exc.__context__ or exc})"
            self.refused("cannot be reached", reason, kind="unresolved")
        self._went_down(reason)
        return self._down_reason

    def _went_down(self, reason: str) -> None:
        self._failed_at = time.monotonic()
        self._backoff = min(BACKOFF_CAP, max(BACKOFF_FLOOR, 2 * self._backoff))
        self._down_reason = f"down: {reason}{RETRIED}"
        self._down_until = time.monotonic() + self._backoff
        self._schedule_retry(self._backoff)  # no-op while a retry is scheduled or under way

    def _open(self, deadline: float, load_scripts: bool = True) -> Link:
        """A new link, its handshake answered (see :meth:`connect`). ``load_scripts``: it also
        loads every script, in the same write (a listening link, which runs none, does not)."""
        if self.unfit:  # nobody contacts it again (the subscriber connects through here too)
            raise Unfit(self.unfit)
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
            commands = handshake_commands(conn)
            # INVARIANT: a master has every script before a link of ours sends one by digest,
            # so that NOSCRIPT (which a reply nobody waits for cannot recover from: see
            # scripts.py) only follows a SCRIPT FLUSH under a live link. A restarted master's
            # links are all new. In the handshake's write: no round trip of its own.
            loads = script_loads() if load_scripts else []
            try:
                replies = link.exchange(
                    b"".join(map(wire.pack, [*commands, *loads])), len(commands) + len(loads), deadline
                )
            except RedisTimeoutError:
                # Say the seconds: a caller that waited longer for its round (an operator's
                # --timeout) sees why the connect itself gave up sooner.
                raise Silent(
                    f"accepted the connection and did not answer within {remaining:.2f} s (a "
                    f"connect's bound: request_timeout, {self._request_timeout:g} s; a paused or "
                    "overloaded server, or no Redis server)"
                ) from None
            link.run_id = self.accept_handshake(commands, replies)
        except BaseException:
            conn.disconnect()
            raise
        return link

    def accept_handshake(self, commands: Sequence[Sequence[Any]], replies: list[Any]) -> str:
        """Check a new link's replies (its handshake's, then its script loads') and return the
        server's run_id; raises, as a connect does, for a server the lock cannot use. Every
        transport's links are accepted here, so that one rule says which servers are masters."""
        return accept(commands, replies, self.refused)

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
        Generation.value += 1
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
