"""Bad input is refused where it is given, naming it, never later as a failing vote.

- ``masters`` that is not a list of masters, a TTL the servers cannot take (``PX`` is a signed
  64-bit count of milliseconds that the server adds to its clock), a ``blocking`` that is not a
  bool, a ``timeout`` that is no number of seconds: a ``ConfigError`` that names the option,
  at construction, in ``lock()``, ``acquire()`` and ``extend()``.
- A master that is no Redis master of its own (a server that does not speak RESP, a cluster
  node, a replica, a Sentinel) is found out at first contact, by the new link's handshake: it is
  refused for the rest of the Redlock's life (never contacted again), votes ``error`` with a
  detail that says what it is, and is reported once at WARNING, naming it. The other masters
  still decide: an acquire goes on without it.
- A master that may only be out for a while (one that accepts and never answers, a host name
  that does not resolve) is reported the same way but not refused: it is down, costs the first
  round at most ``request_timeout`` and later rounds nothing, and is retried in the background.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import pytest
import redis

from celery_redlock import ConfigError, LockNotAcquired, Redlock
from celery_redlock.lock import masters as master_module
from celery_redlock.lock.redlock import MAX_TTL
from celery_redlock.testing import RedisServer, ServerSet, free_port

from .conftest import take, wait_for

pytestmark = pytest.mark.timeout(60)

MASTERS_LOGGER = "celery_redlock.masters"
TIMEOUT = 0.2  # request_timeout of the Redlocks here
# What a loaded 2-core machine may add to one round; not a second timeout.
SLACK = 0.15


# -- arguments ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("masters", [None, 5, 3.5, object()], ids=["None", "int", "float", "object"])
def test_masters_that_is_no_list_of_masters_is_a_config_error(masters: object) -> None:
    with pytest.raises(ConfigError, match=r"^masters"):
        Redlock(masters)  # type: ignore[arg-type]


def test_the_ttl_bound_is_the_servers_own(redlock_masters: ServerSet) -> None:
    """The largest TTL accepted is one every server takes (SET PX and PEXPIRE, on both binaries);
    far above it, the server refuses what we would send."""
    urls = redlock_masters.urls[:3]
    with Redlock(urls, retry_count=0, ttl=MAX_TTL) as rl:
        lock = rl.lock("ttl-at-the-bound")
        assert take(lock), lock.last_error
        assert lock.extend(MAX_TTL)
        client = redlock_masters[0].client()
        try:
            assert client.pttl(lock.key) > 9 * 10**18 // 2  # the TTL sent is the TTL kept
            # The servers' own bound: PX milliseconds plus their clock must fit in 63 bits.
            with pytest.raises(redis.ResponseError):
                client.set("ttl-beyond", "x", px=2**63 - 1)
        finally:
            client.close()
        lock.release()


@pytest.mark.parametrize("ttl", [1e300, 1e17, MAX_TTL * 1.001, 2**63])
def test_a_ttl_the_servers_cannot_take_is_refused_where_it_is_given(
    redlock_masters: ServerSet, ttl: float
) -> None:
    urls = redlock_masters.urls[:3]
    with pytest.raises(ConfigError, match=r"^ttl must be at most"):
        Redlock(urls, ttl=ttl)
    with pytest.raises(ConfigError, match=r"^fence_retention must be at most"):
        Redlock(urls, fence_retention=ttl)
    with Redlock(urls, retry_count=0) as rl:
        with pytest.raises(ConfigError, match=r"^ttl must be at most"):
            rl.lock("too-long", ttl=ttl)
        lock = rl.lock("extended-too-long", ttl=5)
        assert take(lock), lock.last_error
        with pytest.raises(ConfigError, match=r"^ttl must be at most"):
            lock.extend(ttl)
        assert lock.owned()
        lock.release()


def test_a_float_ttl_is_refused_at_zero_and_below_whatever_min_ttl_was_set_to(
    redlock_masters: ServerSet,
) -> None:
    # check_ttl's fast path for a plain float leans on min_ttl, which is public: set lower by
    # hand, it must still not let a TTL of zero or less through.
    with Redlock(redlock_masters.urls[:3], retry_count=0) as rl:
        rl.min_ttl = 0.0
        for ttl in (0.0, -0.0, -0.5):
            with pytest.raises(ConfigError, match=r"^ttl must be > 0 seconds"):
                rl.lock("zero-or-less", ttl=ttl)


def _commands_served(clients: list[redis.Redis]) -> list[int]:
    """How many commands each master has run, but the INFO calls that ask it (commandstats).
    The same clients for every count: a new connection's own handshake would count too."""
    served = []
    for client in clients:
        stats = client.info("commandstats")
        served.append(sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info"))
    return served


@pytest.mark.parametrize("blocking", ["no", 0, 1, None, "False"])
def test_blocking_must_be_a_bool(redlock_masters: ServerSet, blocking: object) -> None:
    """``acquire(blocking="no")`` used to block (a non-empty string is true): on a held lock it
    would wait out every retry. It is refused at once, naming ``blocking``."""
    with Redlock(redlock_masters.urls[:3], retry_count=50, retry_delay=0.2) as rl:
        holder = rl.lock("blocking-typed", ttl=10)
        assert take(holder)
        try:
            contender = rl.lock("blocking-typed", ttl=10)
            clients = [server.client() for server in list(redlock_masters)[:3]]
            before = _commands_served(clients)
            with pytest.raises(ConfigError, match=r"^blocking must be True or False"):
                contender.acquire(blocking=blocking)  # type: ignore[arg-type]
            # Refused before any round: no master was sent a command (an acquire that took the
            # string for true sends one a try, and waits out 50 of them on the held lock).
            assert _commands_served(clients) == before
            with pytest.raises(ConfigError, match=r"^blocking must be True or False"):
                rl.lock("blocking-typed", ttl=10, blocking=blocking)  # type: ignore[arg-type]
        finally:
            holder.release()


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (math.nan, "finite"),
        (-0.5, ">= 0"),
        (-2, ">= 0"),
        (True, "number"),
        ("1", "number"),
        (-math.inf, "finite"),
    ],
)
def test_timeout_must_be_seconds(redlock_masters: ServerSet, timeout: object, error: str) -> None:
    with Redlock(redlock_masters.urls[:3], retry_count=0) as rl:
        lock = rl.lock("timeout-typed", ttl=10)
        with pytest.raises(ConfigError, match=rf"^timeout must be .*{error}"):
            lock.acquire(timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"^timeout must be"):
            rl.lock("timeout-typed", ttl=10, timeout=timeout)  # type: ignore[arg-type]
        assert not lock.owned()


# -- what a master is, found at first contact ---------------------------------------------------------
class Impostor:
    """A loopback TCP server that is not Redis: each chunk it receives gets ``answer(chunk)``
    (None: it never answers). Counts the connections it accepted."""

    def __init__(self, answer: Callable[[bytes], bytes | None]) -> None:
        self.answer = answer
        self.accepted = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            reply = self.answer(data)
            if reply is not None:
                with suppress(OSError):
                    conn.sendall(reply)

    def close(self) -> None:
        self._stop.set()
        for conn in [self.listener, *self._conns]:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._acceptor.join(5)


def _http(data: bytes) -> bytes:
    return b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nBad Request"


def _echo(data: bytes) -> bytes:
    return data


def _silent(data: bytes) -> None:
    return None


class Odd:
    """One odd master for a test: its URL, and how many connections it has taken so far."""

    def __init__(self, url: str, contacts: Callable[[], int], what: str) -> None:
        self.url = url
        self.contacts = contacts
        self.what = what  # a pattern the vote's detail and the WARNING must match


@contextmanager
def odd_master(kind: str) -> Iterator[Odd]:
    """The odd master ``kind`` names; ``cluster`` and ``replica`` are real servers, of the
    embedded binary or (``@redis-server``) of this machine's redis-server, which name their mode
    and role differently."""
    kind, _, binary_name = kind.partition("@")
    binary = shutil.which(binary_name) if binary_name else None
    if kind in ("echo", "http", "silent"):
        impostor = Impostor({"echo": _echo, "http": _http, "silent": _silent}[kind])
        what = {
            "echo": r"not a Redis server.*INFO",
            "http": r"not a Redis server.*HTTP/1\.1 400",
            "silent": r"did not answer",
        }[kind]
        try:
            yield Odd(impostor.url, lambda: impostor.accepted, what)
        finally:
            impostor.close()
        return
    if kind == "unresolvable":
        yield Odd(
            "redis://no-such-host.invalid:6379/0", lambda: 0, r"no-such-host\.invalid.*does not resolve"
        )
        return
    stack: list[RedisServer] = []
    try:
        if kind == "cluster":
            cluster = ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
            stack.append(RedisServer(binary=binary, extra_args=cluster).start())
            what = r"a cluster node"
        elif kind == "replica":
            primary = RedisServer(binary=binary).start()
            stack.append(primary)
            replica_of = ["--replicaof", primary.host, str(primary.port)]
            stack.append(RedisServer(binary=binary, extra_args=replica_of).start())
            what = rf"a replica of {primary.host}:{primary.port}"
        else:
            raise AssertionError(kind)
        inspector = stack[-1].client()  # one connection, opened before the Redlock's
        try:

            def received() -> int:
                return int(inspector.info("stats")["total_connections_received"])

            before = received()
            yield Odd(stack[-1].url, lambda: received() - before, what)
        finally:
            inspector.close()
    finally:
        for server in stack:
            server.cleanup()


REFUSED = ["echo", "http", "cluster", "replica"]
if shutil.which("redis-server"):
    REFUSED += ["cluster@redis-server", "replica@redis-server"]
DOWN = ["silent", "unresolvable"]


def warnings_about(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == MASTERS_LOGGER and record.levelno >= logging.WARNING and name in record.getMessage()
    ]


@pytest.mark.parametrize("kind", REFUSED + DOWN)
def test_a_master_that_is_no_redis_master_of_its_own_is_a_clear_error_at_first_contact(
    caplog: pytest.LogCaptureFixture, redlock_masters: ServerSet, kind: str
) -> None:
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    with odd_master(kind) as odd:
        urls = [*redlock_masters.urls[:2], odd.url]
        with Redlock(urls, retry_count=0, request_timeout=TIMEOUT) as rl:
            name = rl.masters[2].name
            lock = rl.lock(f"odd-{kind}", ttl=10)
            started = time.monotonic()
            # The two real masters decide; the odd one votes error, saying what it is (one that
            # may be out for a while may first be only "not connected" within the round).
            assert take(lock), lock.last_error
            assert time.monotonic() - started < TIMEOUT + SLACK
            vote = lock.last_votes[2]
            assert vote.kind == "error", vote
            if kind in REFUSED:
                assert_matches(odd.what, vote.detail)
                assert vote.detail.startswith("refused: "), vote
            else:
                assert_matches(
                    rf"{odd.what}|not connected within [0-9.]+ s, the round's deadline", vote.detail
                )
                # Known once its connect has failed (at its own deadline, about the round's).
                assert wait_for(lambda: re.search(odd.what, rl.masters[2].unavailable()), 1.0)
            # A contender fails with the votes, and the odd master's says what it is.
            contender = rl.lock(f"odd-{kind}", ttl=10)
            with pytest.raises(LockNotAcquired) as failed, contender:
                pass
            odd_votes = [v for v in failed.value.votes if v.master == name]
            assert len(odd_votes) == 1 and odd_votes[0].kind == "error", failed.value.votes
            assert_matches(odd.what, odd_votes[0].detail)
            assert name in str(failed.value)
            lock.release()

            contacts = odd.contacts()
            # Known from now on: later rounds cost it nothing.
            for n in range(20):
                again = rl.lock(f"odd-{kind}-{n}", ttl=10)
                started = time.monotonic()
                assert take(again), again.last_error
                assert time.monotonic() - started < TIMEOUT / 2, f"round {n}"
                assert again.last_votes[2].kind == "error"
                assert_matches(odd.what, again.last_votes[2].detail)
                again.release()
            if kind in REFUSED:
                # Refused for the rest of the Redlock's life: never contacted again, however long.
                time.sleep(master_module.BACKOFF_CAP + 0.3)
                last = rl.lock(f"odd-{kind}-last", ttl=10)
                assert take(last), last.last_error
                assert last.last_votes[2].detail.startswith("refused: ")
                last.release()
                assert odd.contacts() == contacts == 1, (contacts, odd.contacts())
        logged = warnings_about(caplog, name)
        assert len(logged) == 1, logged
        assert_matches(odd.what, logged[0])


def assert_matches(pattern: str, text: str) -> None:
    assert re.search(pattern, text, re.S), f"{pattern!r} not in {text!r}"
