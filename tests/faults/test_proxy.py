"""The loopback proxy in front of a real server: each fault does what the fault tests rely on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redlock.testing import Proxy, RedisServer


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as instance:
        yield instance


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[Proxy]:
    with Proxy(server.address) as instance:
        yield instance


def client(proxy: Proxy, timeout: float = 1.0) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=proxy.port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def timed(action: object) -> float:
    started = time.monotonic()
    action()  # type: ignore[operator]
    return time.monotonic() - started


@pytest.mark.timeout(30)
def test_forwards_and_delays_each_direction(proxy: Proxy) -> None:
    c = client(proxy)
    assert c.set("k", "v") and c.get("k") == b"v"
    proxy.delay(0.15, "down")
    assert 0.15 <= timed(lambda: c.get("k")) < 0.6
    proxy.delay(0.15, "up")
    assert 0.3 <= timed(lambda: c.get("k")) < 0.8
    proxy.heal()
    assert timed(lambda: c.get("k")) < 0.1
    c.close()


@pytest.mark.timeout(30)
def test_blackhole_holds_bytes_until_heal(proxy: Proxy, server: RedisServer) -> None:
    c = client(proxy, timeout=0.2)
    c.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        c.set("held", "1")
    assert proxy.pending() > 0 and server.client().get("held") is None
    proxy.heal()
    deadline = time.monotonic() + 5
    while server.client().get("held") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.client().get("held") == b"1"  # delivered late, as after a healed partition
    c.close()


@pytest.mark.timeout(30)
def test_drop_discards_and_heal_resets_the_corrupted_stream(proxy: Proxy, server: RedisServer) -> None:
    c = client(proxy, timeout=0.2)
    c.ping()
    proxy.drop()
    with pytest.raises(redis.TimeoutError):
        c.set("dropped", "1")
    proxy.heal()
    assert proxy.connections() == 0
    assert server.client().get("dropped") is None
    assert client(proxy).ping()


@pytest.mark.timeout(30)
def test_cut_resets_open_and_new_connections(proxy: Proxy) -> None:
    c = client(proxy)
    c.ping()
    proxy.cut()
    with pytest.raises(redis.ConnectionError):
        c.ping()
    with pytest.raises(redis.ConnectionError):
        client(proxy).ping()
    proxy.heal()
    assert client(proxy).ping()


@pytest.mark.timeout(30)
def test_each_listener_is_its_own_view_of_the_master(server: RedisServer) -> None:
    with Proxy(server.address) as group_a, Proxy(server.address) as group_b:
        group_a.cut()
        with pytest.raises(redis.ConnectionError):
            client(group_a).ping()
        assert client(group_b).ping()


@pytest.mark.timeout(30)
def test_a_killed_master_resets_the_clients_connection() -> None:
    with RedisServer() as doomed, Proxy(doomed.address) as proxy:
        c = client(proxy)
        c.ping()
        doomed.kill()
        with pytest.raises(redis.ConnectionError):
            c.ping()
