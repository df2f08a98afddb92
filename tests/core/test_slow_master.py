"""Acquisition slower than the TTL is reported as a failure and leaves no keys.

Every master's reply arrives (a majority of them delayed by a loopback TCP proxy the tests own,
well within the request timeout) and every master grants: what fails the attempt is only that
more than the TTL passed between the start of the round and the holder looking at its result,
so no validity is left (step 3 of the algorithm). The attempt must then release on every master.

A TTL must be at least what one round can take (``Redlock.min_ttl``), so the masters' delay
alone can no longer overrun it; what still can is the holder itself stalling after the masters
answered (a long GC, a SIGSTOP), which the Redlock below does on demand.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.commands import PLAIN, Commands
from celery_redlock.testing import ProxySet, ServerSet

from ..waiting import wait_for, wait_until

# The subject is a stall after the round overrunning the TTL, not the masters' speed: every
# master must grant in time, so request_timeout is one a loaded host keeps (0.2 s was missed),
# and the TTL (at least min_ttl) and the stall (more than the TTL) follow it.
TTL = 1.05
REPLY_DELAY = 0.05  # < REQUEST_TIMEOUT
REQUEST_TIMEOUT = 1.0  # the least TTL it allows is 1.0121 s
STALL = 1.2  # > TTL
KEY_PREFIX = "slowtest:"


class StallsAfterTheRound(Redlock):
    """A holder that stalls for ``stall`` seconds after the masters answered its acquire."""

    stall = 0.0

    def try_acquire(self, key: str, token: str, ttl: float, commands: Commands = PLAIN) -> Any:
        result = super().try_acquire(key, token, ttl, commands)
        time.sleep(self.stall)
        return result


@pytest.fixture
def proxies(redlock_masters: ServerSet) -> Iterator[ProxySet]:
    with ProxySet(server.address for server in redlock_masters) as proxy_set:
        yield proxy_set


def command_calls(server_set: ServerSet, *names: str) -> list[int]:
    """How many calls of these commands each master has executed since its stats reset."""
    counts = []
    for server in server_set:
        client = server.client()
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        counts.append(sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names))
    return counts


def keys_left(server_set: ServerSet) -> dict[str, list[bytes]]:
    left = {}
    for server in server_set:
        client = server.client()
        try:
            keys = list(client.scan_iter(match=KEY_PREFIX + "*"))
        finally:
            client.close()
        if keys:
            left[server.address] = keys
    return left


@pytest.mark.timeout(30)
def test_acquisition_slower_than_ttl_fails_and_leaves_no_keys(
    redlock_masters: ServerSet, proxies: ProxySet
) -> None:
    with StallsAfterTheRound(
        proxies.urls, ttl=TTL, request_timeout=REQUEST_TIMEOUT, retry_count=0, key_prefix=KEY_PREFIX
    ) as redlock:
        # Control: through the same proxies with no delay, the same lock is granted.
        control = redlock.lock("invoice:slow")
        assert control.acquire(blocking=False), control.last_error
        control.release()
        # The release returns on a quorum; the last master may apply it a moment later. Its
        # script call must land before the counters are reset, or it is counted as this round's.
        assert wait_for(lambda: keys_left(redlock_masters) == {}, 5), keys_left(redlock_masters)

        for server in redlock_masters:
            client = server.client()
            try:
                client.config_resetstat()
            finally:
                client.close()
        for proxy in proxies[:3]:  # a majority: no quorum can be formed of fast masters alone
            proxy.delay(REPLY_DELAY, "down")
        redlock.stall = STALL

        lock = redlock.lock("invoice:slow")
        started = time.monotonic()
        acquired = lock.acquire(blocking=False)
        took = time.monotonic() - started

        assert not acquired
        assert not lock.owned()
        error = lock.last_error
        assert error is not None
        # Every master granted, and in time for the request timeout: only the TTL was overrun.
        assert [vote.kind for vote in error.votes] == ["yes"] * 5, str(error)
        assert REPLY_DELAY <= error.elapsed < REQUEST_TIMEOUT
        assert error.validity <= 0
        assert TTL < took < REQUEST_TIMEOUT + STALL

        # The retraction is sent without waiting for its replies (nobody saw the lock held), so
        # wait on what it means: every master has run the release script and holds nothing of
        # ours. Whether its late reply has reached us yet is not this test's subject.
        calls: list[int] = []

        def released_everywhere() -> bool:
            nonlocal calls
            calls = command_calls(redlock_masters, "evalsha", "eval")
            return all(count >= 1 for count in calls) and keys_left(redlock_masters) == {}

        wait_until(released_everywhere, 5.0, "every master ran the retraction")
        assert command_calls(redlock_masters, "set") == [1] * 5, "one acquire (SET) per master"
        assert calls == [1] * 5, f"release script calls per master: {calls}"
        assert keys_left(redlock_masters) == {}
