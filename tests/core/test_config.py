"""Bad settings fail at construction, naming the bad value; odd inputs are handled."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import redis

from celery_redlock import ConfigError, Redlock, RedlockWarning
from celery_redlock.lock.resource import MAX_NAME_LENGTH
from celery_redlock.testing import RedisServer, ServerSet
from tests import tls

from .conftest import take, wait_for


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": -1}, "ttl"),
        ({"ttl": "30"}, "ttl"),
        ({"ttl": True}, "ttl"),
        ({"drift_factor": -0.1}, "drift_factor"),
        ({"drift_factor": 0.5}, "drift_factor"),
        ({"request_timeout": 0}, "request_timeout"),
        ({"retry_count": -1}, "retry_count"),
        ({"retry_count": 1.5}, "retry_count"),
        ({"retry_delay": -0.1}, "retry_delay"),
        ({"key_prefix": None}, "key_prefix"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Redlock(["redis://127.0.0.1:1/0"], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("masters", "named"),
    [
        ([], "at least one"),
        (["http://127.0.0.1:6379"], "http://127.0.0.1:6379"),
        (["127.0.0.1:6379"], "127.0.0.1:6379"),
        ([42], "int"),
        (
            ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"],
            "127.0.0.1:7001",
        ),
        (["redis://127.0.0.1:notaport/0"], "notaport"),
    ],
)
def test_bad_masters_are_named(masters: list[object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Redlock(masters)


def test_even_number_of_masters_warns() -> None:
    with pytest.warns(RedlockWarning, match="even"):
        Redlock(["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"])


def test_nothing_is_sent_at_construction() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rl = Redlock(["redis://127.0.0.1:1/0"])  # port 1: nobody listens
    lock = rl.lock("x")
    assert not lock.acquire(blocking=False)
    assert lock.last_error is not None and lock.last_error.votes[0].kind == "error"


@pytest.mark.parametrize("name", [None, 42, b"bytes", ""])
def test_bad_lock_names(name: object) -> None:
    rl = Redlock(["redis://127.0.0.1:1/0"])
    with pytest.raises(ConfigError, match="lock name"):
        rl.lock(name)  # type: ignore[arg-type]


def test_timeout_with_nonblocking_is_refused(redlock: Redlock) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        redlock.lock("x").acquire(blocking=False, timeout=1)


def test_very_long_and_unicode_names(redlock: Redlock, redlock_masters: ServerSet) -> None:
    long_name = "invoice:" + "x" * 100_000
    lock = redlock.lock(long_name, ttl=5)
    assert take(lock)
    assert len(lock.key) < MAX_NAME_LENGTH + 100
    other = redlock.lock("invoice:" + "x" * 99_999 + "y", ttl=5)
    assert other.key != lock.key and other.acquire(blocking=False)  # digests keep them apart
    lock.release()
    other.release()
    uni = redlock.lock("facture:ÉTÉ-☃", ttl=5)
    assert take(uni)
    assert redlock_masters[0].client().exists("redlock:facture:ÉTÉ-☃")
    uni.release()


def test_redis_client_objects_and_prefix(redlock_masters: ServerSet) -> None:
    clients = [s.client() for s in redlock_masters]
    with Redlock(clients, key_prefix="app1:") as rl:
        lock = rl.lock("res", ttl=5)
        assert take(lock)
        assert clients[0].exists("app1:res") and not clients[0].exists("redlock:res")
        lock.release()


def test_password_acl_user_and_unix_socket() -> None:
    """Masters reached with a password, an ACL user, and a unix socket, in one Redlock."""
    with (
        RedisServer(extra_args=["--requirepass", "s3cret"]) as with_password,
        RedisServer(extra_args=["--user", "locker", "on", ">pw", "~*", "+@all"]) as with_acl,
    ):
        plain = RedisServer()
        sock = plain.dir / "redis.sock"
        plain.extra_args = ("--unixsocket", str(sock), "--unixsocketperm", "700")
        with plain:
            urls = [
                f"redis://:s3cret@{with_password.address}/0",
                f"redis://locker:pw@{with_acl.address}/0",
                f"unix://{sock}?db=0",
            ]
            # Not a timed test: a loaded host's connect and AUTH may outlast the default 0.1 s,
            # and each master's vote is the subject.
            with Redlock(urls, request_timeout=2.0) as rl:
                lock = rl.lock("auth", ttl=5)
                assert take(lock), lock.last_error
                assert [v.kind for v in lock.last_votes] == ["yes", "yes", "yes"]
                assert str(sock) in {m.name for m in rl.masters}
                lock.release()
            with Redlock([f"redis://:wrong@{with_password.address}/0"], request_timeout=2.0) as bad:
                lock = bad.lock("auth", ttl=5)
                assert not lock.acquire(blocking=False)
                vote = lock.last_error.votes[0]  # type: ignore[union-attr]
                assert vote.kind == "error" and "pass" in vote.detail.lower()


def test_single_master_mode(redlock_masters: ServerSet) -> None:
    with Redlock([redlock_masters[0].url]) as rl:
        assert rl.quorum == 1
        lock = rl.lock("solo", ttl=5)
        assert take(lock)
        assert not rl.lock("solo").acquire(blocking=False)
        lock.release()


def test_raw_redis_errors_never_escape(redlock_masters: ServerSet) -> None:
    # A master holding something unexpected (a list under the lock key) answers the scripts'
    # GET with WRONGTYPE: that is a failed vote, never an exception.
    client = redlock_masters[0].client()
    client.rpush("redlock:wrongtype", "x")
    with Redlock(redlock_masters.urls) as rl:
        lock = rl.lock("wrongtype", ttl=5)
        try:
            assert take(lock)
            assert lock.last_votes[0].kind == "held"  # SET NX refuses an existing key
            assert lock.extend()
            assert lock.last_votes[0].kind == "error"
            assert "WRONGTYPE" in lock.last_votes[0].detail
            lock.release()
        except redis.RedisError as exc:  # pragma: no cover - the failure this test guards
            pytest.fail(f"raw redis error escaped: {exc!r}")
    assert client.type("redlock:wrongtype") == b"list"


@pytest.mark.skipif(not tls.available(), reason=tls.MISSING)
def test_tls_master(tmp_path: Path) -> None:
    with tls.tls_servers(tmp_path, 1) as [(server, tls_port)]:
        trusted = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp_path / 'ca.crt'}"
        with Redlock([trusted]) as rl:
            lock = rl.lock("tls", ttl=5)
            # Retried: a TLS handshake on a loaded machine may outlast the first round's
            # request_timeout; the link it makes serves the next round.
            assert lock.acquire(timeout=5), lock.last_error
            assert server.client().get("redlock:tls") == lock.token.encode()  # type: ignore[union-attr]
            lock.release()
        with Redlock([f"rediss://127.0.0.1:{tls_port}/0"]) as untrusted:
            lock = untrusted.lock("tls", ttl=5)

            def verdict() -> str:
                assert not lock.acquire(blocking=False)  # never granted by a server it cannot trust
                return lock.last_error.votes[0].detail  # type: ignore[union-attr]

            # The handshake's verdict, once it is in: on a loaded host the handshake may outlast
            # a round's request_timeout ("not connected within"), and a later round reports it.
            assert wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in verdict(), 10, every=0.1), verdict()
