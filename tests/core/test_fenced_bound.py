"""An acquire returns by its timeout plus one request_timeout, whatever the kind of lock.

A fenced grant is two rounds (the grant, then the fence's write-back) and, after a master lost its
scripts (``SCRIPT FLUSH``, a restart), each of them may be sent twice (by digest, then the source
to a master that answered NOSCRIPT). All of that shares the one deadline of the attempt: a master
too slow for two round trips within request_timeout leaves a fenced attempt failed, never late.

Every master here answers through a loopback proxy that holds each reply 85% of request_timeout:
one round trip fits in the bound, two do not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import take

pytestmark = [pytest.mark.one_binary, pytest.mark.timeout(60)]

TIMEOUT = 0.2  # request_timeout
REPLY_DELAY = 0.85 * TIMEOUT
# What a loaded 2-core machine may add (the proxy's thread, wake-ups); well under a second
# round trip (REPLY_DELAY), which is what an overrun costs.
SLACK = 0.06
KINDS = {
    "plain": {},
    "fair": {"fair": True},
    "reentrant": {"reentrant": True},
    "fenced": {"fenced": True},
}


@pytest.fixture
def proxies(redlock_masters: ServerSet) -> Iterator[ProxySet]:
    with ProxySet(server.address for server in list(redlock_masters)[:3]) as proxy_set:
        yield proxy_set


def flush_scripts(masters: ServerSet) -> None:
    for server in list(masters)[:3]:
        client = server.client()
        try:
            client.script_flush()
        finally:
            client.close()


@pytest.mark.parametrize("flushed", [False, True], ids=["scripts-cached", "scripts-flushed"])
@pytest.mark.parametrize("how", ["timeout=0", "blocking=False", "timeout=0.3"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_acquire_returns_by_its_timeout_plus_one_request_timeout(
    redlock_masters: ServerSet, proxies: ProxySet, kind: str, how: str, flushed: bool
) -> None:
    wait = 0.3 if how == "timeout=0.3" else 0.0
    with Redlock(proxies.urls, retry_count=0, request_timeout=TIMEOUT, retry_delay=0.05) as rl:
        # Links made (and scripts loaded) before the masters slow down: what is timed is the
        # attempts, not the connects.
        warm = rl.lock(f"bound-{kind}-warm", ttl=10, **KINDS[kind])  # type: ignore[call-overload]
        assert take(warm), warm.last_error
        warm.release()
        for proxy in proxies:
            proxy.delay(REPLY_DELAY, "down")
        if flushed:
            flush_scripts(redlock_masters)
        lock = rl.lock(f"bound-{kind}", ttl=10, **KINDS[kind])  # type: ignore[call-overload]
        started = time.monotonic()
        if how == "blocking=False":
            lock.acquire(blocking=False)
        else:
            lock.acquire(timeout=wait)
        elapsed = time.monotonic() - started
        assert elapsed < wait + TIMEOUT + SLACK, (
            f"{kind} acquire({how}) took {elapsed:.3f} s; the bound is {wait + TIMEOUT:.3f} s "
            f"(votes: {lock.last_votes})"
        )
        if lock.owned():
            lock.release()
        proxies.heal()
