"""AsyncRedlock over TLS (``rediss://``), on three real redis-server masters with a private CA
(tests/tls.py): the lock's operations and the wait woken by the release over TLS links, the
context built from redis-py's ``ssl_*`` options, a paused master's TLS handshake bounded by
``request_timeout``, and a certificate that does not verify refused at once, saying why."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redlock import AsyncRedlock, ConfigError
from celery_redlock.lock.aio.tls import tls_context, tls_contexts, tls_options
from celery_redlock.lock.transport.master import Master
from celery_redlock.testing import RedisServer
from tests import tls

from .conftest import SLOW, WOKEN_BY_NOTICE, run, take

pytestmark = pytest.mark.timeout(60)

# A TLS handshake on a loaded 2-core machine can outlast the default 0.1 s; this test file is
# about what goes over TLS, not about that bound (but for the paused master's test).
ROOMY = 1.0


class Masters:
    def __init__(self, servers: list[tuple[RedisServer, int]], folder: Path) -> None:
        self.servers = [server for server, _ in servers]
        self.ports = [port for _, port in servers]
        self.ca = folder / "ca.crt"

    def urls(self, query: str) -> list[str]:
        return [f"rediss://127.0.0.1:{port}/0?{query}" for port in self.ports]

    def verified(self) -> list[str]:
        """Certificate and host name checked against the private CA."""
        return self.urls(f"ssl_cert_reqs=required&ssl_ca_certs={self.ca}")

    def keys_on_each(self) -> list[list[bytes]]:
        found = []
        for server in self.servers:
            client = server.client()
            try:
                found.append(sorted(client.keys("redlock:*")))
            finally:
                client.close()
        return found


@pytest.fixture(scope="module")
def masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Masters]:
    folder = tmp_path_factory.mktemp("tls")
    with tls.tls_servers(folder, 3) as servers:
        yield Masters(servers, folder)


@pytest.fixture(autouse=True)
def clean(masters: Masters) -> Iterator[None]:
    for server in masters.servers:
        if server.paused:
            server.resume()
        server.flushall()
    yield
    for server in masters.servers:
        if server.paused:
            server.resume()


async def _keys_gone(masters: Masters, within: float = 5.0) -> bool:
    """Whether every key is gone by ``within`` (the replies past the quorum's are on their way)."""
    deadline = time.monotonic() + within
    while masters.keys_on_each() != [[]] * 3:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_acquire_extend_release_and_a_woken_waiter_over_tls(masters: Masters) -> None:
    async def main() -> float:
        urls = masters.verified()
        async with (
            AsyncRedlock(urls, ttl=10.0, request_timeout=ROOMY, **SLOW) as one,
            AsyncRedlock(urls, ttl=10.0, request_timeout=ROOMY, **SLOW) as two,
        ):
            lock = one.lock("tls-job", holder="tls holder")
            assert await take(lock), lock.last_error
            assert [len(keys) for keys in masters.keys_on_each()] == [1, 1, 1]
            assert not await two.lock("tls-job").acquire(blocking=False)
            assert await two.holder("tls-job") == "tls holder"
            assert await lock.extend(5.0) and lock.validity <= 5.0
            # A waiter over TLS links, its listening links TLS too, woken by the release.
            waiter = two.lock("tls-job")
            waiting = asyncio.create_task(waiter.acquire(timeout=8))
            for _ in range(300):
                if two.subscriber.listening() == 3:
                    break
                await asyncio.sleep(0.01)
            assert two.subscriber.listening() == 3
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert await lock.release()
            released = time.monotonic()
            assert await asyncio.wait_for(waiting, 8)
            took = time.monotonic() - released
            assert await waiter.release()
            assert await _keys_gone(masters)
            return took

    took = run(main())
    assert took < WOKEN_BY_NOTICE, took  # a poll would come seconds after the release


def test_many_tasks_never_overlap_over_tls(masters: Masters) -> None:
    inside = most = holds = 0

    async def worker(rl: AsyncRedlock) -> None:
        nonlocal inside, most, holds
        for _ in range(5):
            async with rl.lock("tls-shared", timeout=10):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.002)
                inside -= 1
                holds += 1

    async def main() -> None:
        urls = masters.verified()
        async with (
            AsyncRedlock(urls, ttl=5.0, request_timeout=ROOMY) as one,
            AsyncRedlock(urls, ttl=5.0, request_timeout=ROOMY) as two,
        ):
            await asyncio.wait_for(asyncio.gather(*(worker(one if k % 2 else two) for k in range(8))), 30)
            assert await _keys_gone(masters)

    run(main())
    assert (most, holds) == (1, 40)


def test_a_redis_client_with_ssl_options_is_a_tls_master(masters: Masters) -> None:
    clients = [
        redis.Redis(
            host="localhost", port=port, ssl=True, ssl_cert_reqs="required", ssl_ca_certs=str(masters.ca)
        )
        for port in masters.ports
    ]

    async def main() -> None:
        async with AsyncRedlock(clients, ttl=5.0, request_timeout=ROOMY) as rl:
            lock = rl.lock("tls-client")
            assert await take(lock), lock.last_error
            assert await lock.release()

    run(main())


def test_a_paused_tls_master_costs_a_round_its_request_timeout(masters: Masters) -> None:
    """Its kernel accepts the TCP connection; the TLS handshake is never answered."""

    async def main() -> tuple[float, float, set[asyncio.Task[Any]]]:
        masters.servers[0].pause()
        rl = AsyncRedlock(masters.verified(), ttl=10.0, request_timeout=0.5, retry_count=0)
        lock = rl.lock("tls-paused")
        started = time.monotonic()
        got = await lock.acquire(blocking=False)
        first = time.monotonic() - started
        # A loaded machine's first handshakes may be late: the quorum is asked of again.
        assert got or await take(lock), lock.last_error
        assert lock.last_votes[0].kind != "ok"
        assert await lock.release()
        # Again, with the links to the others made: the paused one costs the same bound.
        started = time.monotonic()
        got = await lock.acquire(blocking=False)
        second = time.monotonic() - started
        assert got or await take(lock), lock.last_error
        assert await lock.release()
        await asyncio.wait_for(rl.aclose(), 5)  # a handshake still under way is ended too
        return first, second, {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    first, second, left = run(main())
    assert first < 0.5 + 0.4, first
    assert second < 0.5 + 0.4, second
    assert left == set()


def test_a_certificate_from_another_ca_is_refused_at_once(masters: Masters, tmp_path: Path) -> None:
    tls.make_ca(tmp_path)  # a CA that signed none of the masters' certificates
    wrong = masters.urls(f"ssl_cert_reqs=required&ssl_ca_certs={tmp_path / 'ca.crt'}")

    async def main() -> tuple[bool, float, list[str]]:
        async with AsyncRedlock(wrong, ttl=30.0, request_timeout=5.0, retry_count=0) as rl:
            lock = rl.lock("tls-wrong")
            started = time.monotonic()
            got = await lock.acquire(blocking=False)
            took = time.monotonic() - started
            assert lock.last_error is not None
            return got, took, [vote.detail for vote in lock.last_error.votes]

    got, took, details = run(main())
    assert not got
    assert took < 2.0, took  # refused by the handshake, not waited out (request_timeout 5)
    assert all("CERTIFICATE_VERIFY_FAILED" in detail for detail in details), details
    assert masters.keys_on_each() == [[]] * 3


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("ssl_cert_reqs=sometimes", "ssl_cert_reqs"),
        ("ssl_min_version=9", "ssl_min_version"),
    ],
)
def test_tls_options_it_cannot_use_are_named_at_construction(query: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        AsyncRedlock([f"rediss://127.0.0.1:1/0?{query}"])


def test_a_tls_file_that_cannot_be_read_is_named_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:1: cannot build its TLS context.*No such file"):
        AsyncRedlock([f"rediss://127.0.0.1:1/0?ssl_ca_certs={tmp_path / 'missing.crt'}"])


def test_masters_with_the_same_tls_options_share_one_context() -> None:
    masters = [Master.from_spec(f"rediss://127.0.0.1:{port}/0", 1.0) for port in (1, 2)]
    masters.append(Master.from_spec("rediss://127.0.0.1:3/0?ssl_cert_reqs=none", 1.0))
    masters.append(Master.from_spec("redis://127.0.0.1:4/0", 1.0))
    one, two, other, plain = tls_contexts(masters)
    assert one is two and other is not one and plain is None


def test_ocsp_which_asyncio_cannot_check_is_refused_at_construction() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, ssl=True, ssl_validate_ocsp_stapled=True)
    with pytest.raises(ConfigError, match="ssl_validate_ocsp_stapled"):
        AsyncRedlock([client])


@pytest.mark.parametrize(
    ("query", "mode", "hostname"),
    [
        ("", ssl.CERT_REQUIRED, True),  # redis-py's defaults (6 and later: the host name checked)
        ("ssl_cert_reqs=none", ssl.CERT_NONE, False),  # nothing verified: no host name to check
        ("ssl_cert_reqs=optional&ssl_check_hostname=false", ssl.CERT_OPTIONAL, False),
        ("ssl_cert_reqs=required&ssl_check_hostname=false", ssl.CERT_REQUIRED, False),
    ],
)
def test_the_context_follows_redis_py_options(query: str, mode: ssl.VerifyMode, hostname: bool) -> None:
    if query == "" and redis.VERSION < (6,):
        hostname = False  # redis-py 5 checked no host name unless asked
    master = Master.from_spec(f"rediss://127.0.0.1:1/0?{query}", 1.0)
    options = tls_options(master)
    assert options is not None
    context = tls_context(options)
    assert (context.verify_mode, context.check_hostname) == (mode, hostname)


def test_a_plain_master_has_no_tls() -> None:
    assert tls_options(Master.from_spec("redis://127.0.0.1:1/0", 1.0)) is None
    context = tls_context(tls_options(Master.from_spec("rediss://h:1/0?ssl_min_version=772", 1.0)) or {})
    assert context.minimum_version == ssl.TLSVersion.TLSv1_3


def test_tls_on_uvloop(masters: Masters) -> None:
    """uvloop has a TLS implementation of its own (not asyncio's sslproto)."""
    uvloop = pytest.importorskip(
        "uvloop", reason="uvloop is not installed (pip install 'celery-redlock[test]')"
    )

    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with AsyncRedlock(masters.verified(), ttl=10.0, request_timeout=ROOMY, **SLOW) as rl:
            held = rl.lock("tls-uv")
            assert await take(held), held.last_error
            assert await held.extend()
            waiting = asyncio.create_task(rl.lock("tls-uv").acquire(timeout=8))
            for _ in range(300):
                if rl.subscriber.listening() == 3:
                    break
                await asyncio.sleep(0.01)
            assert await held.release()
            assert await asyncio.wait_for(waiting, 2.0)  # woken by the release (wait_poll is 5 s)

    uvloop.run(main())
