"""What a master answers, and what it is, are checked where a lock would otherwise fail silently.

A master that refuses our commands (an ACL user without EVAL, a replica, a full server, a cluster
node, a server that is not Redis at all) is reported at WARNING on ``celery_redlock.masters``,
naming the master and the error, once per master and kind of error per minute: every release of
an ACL user without EVAL fails, and a log line per release would drown the log.

A master that is not an independent server is refused when the Redlock is built: a Sentinel- or
Cluster-managed client (a failover promotes a replica that never saw our keys, and the locks on it
are gone), or a second database or second name of a server already listed (one server would cast
several votes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import pytest
import redis
import redis.sentinel
from redis.cluster import RedisCluster

from celery_redlock import ConfigError, Redlock
from celery_redlock.testing import RedisServer, ServerSet, free_port

from .conftest import take

pytestmark = pytest.mark.timeout(60)

MASTERS_LOGGER = "celery_redlock.masters"


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == MASTERS_LOGGER and record.levelno >= logging.WARNING
    ]


# -- refusals ---------------------------------------------------------------------------------------
def test_release_refused_by_an_acl_user_without_eval_is_warned_once_per_master(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    with ServerSet(3) as servers:
        for server in servers:
            admin = server.client()
            try:
                admin.execute_command(
                    "ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-eval", "-evalsha"
                )
            finally:
                admin.close()
        urls = [f"redis://limited:pw@{server.address}/0" for server in servers]
        with Redlock(urls, retry_count=0) as rl:
            for n in range(5):
                lock = rl.lock(f"limited-{n}", ttl=5)
                assert take(lock), lock.last_error  # SET is allowed
                lock.release()  # EVALSHA is not: every master refuses it
            # A release is sent, not waited for: its reply is read by the link's next use.
            rl.holders("redlock:limited-0")
        logged = warnings_logged(caplog)
        for server in servers:
            about = [message for message in logged if server.address in message]
            assert len(about) == 1, f"{server.address}: {about}"
            assert "NOPERM" in about[0]
        assert len(logged) == len(servers), logged


def _replica(stack: list[RedisServer]) -> str:
    primary, replica = RedisServer().start(), RedisServer().start()
    stack += [primary, replica]
    client = replica.client()
    try:
        client.execute_command("REPLICAOF", primary.host, str(primary.port))
    finally:
        client.close()
    return replica.url


def _full(stack: list[RedisServer]) -> str:
    server = RedisServer().start()
    stack.append(server)
    client = server.client()
    try:
        client.config_set("maxmemory", 1)
        client.config_set("maxmemory-policy", "noeviction")
    finally:
        client.close()
    return server.url


def _password_not_given(stack: list[RedisServer]) -> str:
    server = RedisServer(extra_args=["--requirepass", "s3cret"]).start()
    stack.append(server)
    return server.url


def cluster_node_args() -> list[str]:
    # The cluster bus port is given, not left at 10000 above the server's port: a free port is
    # often above 55535, where that would not exist.
    return ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]


def _cluster_node_without_slots(stack: list[RedisServer]) -> str:
    server = RedisServer(extra_args=cluster_node_args()).start()
    stack.append(server)
    return server.url


@pytest.mark.parametrize(
    ("make", "error"),
    [
        # Found by the handshake (INFO): refused before anything is sent (test_seams_input.py).
        (_replica, "a replica of"),
        (_full, "OOM"),
        # redis-py reads the NOAUTH of its first command on connect and names it this way.
        (_password_not_given, "Authentication required"),
        (_cluster_node_without_slots, "a cluster node"),
    ],
    ids=["replica", "out-of-memory", "no-auth", "cluster-node"],
)
def test_a_master_that_refuses_our_commands_is_warned_once(
    caplog: pytest.LogCaptureFixture, make: Callable[[list[RedisServer]], str], error: str
) -> None:
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    stack: list[RedisServer] = []
    try:
        url = make(stack)
        # Not a timed test: the master's refusal is the subject, not an answer within 0.1 s (a
        # late one on a loaded host would vote "timeout").
        with Redlock([url], retry_count=0, request_timeout=2.0) as rl:
            for n in range(3):
                lock = rl.lock(f"refused-{n}", ttl=5)
                assert not lock.acquire(blocking=False)
                vote = lock.last_votes[0]
                assert vote.kind == "error" and error in vote.detail, vote
            name = rl.masters[0].name
        # The refusal's warnings: on a loaded host a connect may also be reported silent (it
        # did not answer within its bound), which is another event, warned on its own.
        logged = [message for message in warnings_logged(caplog) if error in message]
        assert len(logged) == 1, warnings_logged(caplog)
        assert name in logged[0], logged[0]
    finally:
        for server in stack:
            server.cleanup()


@contextmanager
def impostor(answer: Callable[[bytes], bytes]) -> Iterator[int]:
    """A loopback TCP server that is not Redis: each chunk it receives gets ``answer(chunk)``."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(answer(data))

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        for conn in [listener, *conns]:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        acceptor.join(5)


def _http(data: bytes) -> bytes:
    return b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\nConnection: close\r\n\r\nBad Request"


def _echo(data: bytes) -> bytes:
    return data


@pytest.mark.parametrize("answer", [_http, _echo], ids=["http", "echo"])
def test_a_server_that_is_not_redis_is_warned_not_raised(
    caplog: pytest.LogCaptureFixture, redlock_masters: ServerSet, answer: Callable[[bytes], bytes]
) -> None:
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    with impostor(answer) as port:
        name = f"127.0.0.1:{port}"
        urls = [*redlock_masters.urls[:2], f"redis://{name}/0"]
        with Redlock(urls, retry_count=0, request_timeout=0.5) as rl:
            for n in range(3):
                lock = rl.lock(f"impostor-{n}", ttl=5)
                started = time.monotonic()
                assert take(lock), lock.last_error  # two real masters of three
                assert time.monotonic() - started < 1.0
                assert lock.last_votes[2].kind == "error", lock.last_votes
                assert lock.extend()
                lock.release()
        logged = warnings_logged(caplog)
        assert len(logged) == 1, logged
        assert name in logged[0], logged[0]


# -- masters that are not independent ---------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        "redis+sentinel://127.0.0.1:26379/mymaster",
        "sentinel://127.0.0.1:26379/mymaster",
    ],
)
def test_sentinel_urls_are_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"(?s)Sentinel.*failover"):
        Redlock([spec, "redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"])


def test_sentinel_clients_are_refused() -> None:
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", free_port())], socket_timeout=0.1)
    with pytest.raises(ConfigError, match=r"(?s)Sentinel.*failover"):
        Redlock([sentinel])
    managed = sentinel.master_for("mymaster", socket_timeout=0.1)  # connects lazily: nothing sent
    with pytest.raises(ConfigError, match=r"(?s)Sentinel.*failover"):
        Redlock([managed, "redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"])


def test_cluster_clients_are_refused() -> None:
    with RedisServer(extra_args=cluster_node_args()) as server:
        admin = server.client()
        try:
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        finally:
            admin.close()
        cluster = RedisCluster(host=server.host, port=server.port, socket_timeout=2.0)
        try:
            with pytest.raises(ConfigError, match=r"(?s)Cluster.*independent"):
                Redlock([cluster])
        finally:
            cluster.close()


def test_two_databases_of_one_server_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:7001.*127\.0\.0\.1:7001/1"):
        Redlock(["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7001/1", "redis://127.0.0.1:7002/0"])
    with pytest.raises(ConfigError, match=r"localhost:7001/2.*localhost:7001/3"):
        Redlock([redis.Redis(port=7001, db=2), redis.Redis(port=7001, db=3), redis.Redis(port=7002)])


def test_two_names_of_one_server_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"localhost:7001.*127\.0\.0\.1:7001"):
        Redlock(["redis://localhost:7001/0", "redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"])
    # The IPv6 loopback is the same host as the IPv4 one (a server's default bind is both).
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:7001.*::1:7001"):
        Redlock(["redis://127.0.0.1:7001/0", "redis://[::1]:7001/0", "redis://127.0.0.1:7002/0"])


def test_one_unix_socket_under_two_paths_is_refused(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "redis.sock")
    alias = os.path.join(tmp_path, "alias.sock")
    os.symlink(path, alias)
    with pytest.raises(ConfigError, match=r"redis\.sock"):
        Redlock([f"unix://{path}?db=0", f"unix://{path}?db=1", "redis://127.0.0.1:7002/0"])
    with pytest.raises(ConfigError, match=r"alias\.sock"):
        Redlock([f"unix://{path}", f"unix://{alias}", "redis://127.0.0.1:7002/0"])


def test_distinct_servers_and_unresolvable_names_are_accepted() -> None:
    started = time.monotonic()
    rl = Redlock(
        ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/1", "redis://no-such-host.invalid:7001/0"]
    )
    assert len(rl.masters) == 3
    assert time.monotonic() - started < 3.0
