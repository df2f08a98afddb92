"""A fence recorded by a minority of masters is not a grant (issue 25, "make the suite catch
what it missed"), on real masters.

The rule attacked (fencing.py, step 3): a grant needs its fence written back to a quorum W.
Were a write-back acknowledged by a minority accepted, a later grant whose quorum misses that
minority would read counters that never saw the fence, and issue it again (or a lower one).

Every master of a plain test set shares one clock, and the clock floor then hides the bug: a
later reading of any master's clock is above every earlier fence. Here the counters are seeded
far above every clock, so only the counters carry the order, and the write-back is made to fail
on a majority without any timing race:

- masters 0 and 1 run on the real clock, masters 2, 3 and 4 under libfaketime at 100 times real
  speed, each behind a fault proxy;
- the requests to masters 2-4 are delayed by ``DELAY`` (0.2 s) on the way up, so a write-back
  reaches them at least ``DELAY`` after the round-1 SET did, while the fenced key, set with a
  2 s TTL, lives 20 ms of real time there: it is gone, and the write-back answers 0 ("held").
  The client's own validity (2 s less two delayed rounds) is still positive;
- so grant A's fence H+1 is recorded on masters 0 and 1 only; the protocol refuses A;
- grant B then runs with masters 0 and 1 cut off (and 2-4 prompt): its quorum 2-4 reads H and
  issues H+1, the fence A would have carried.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.fencing import COUNTER_SUFFIX
from celery_redlock.testing import ProxySet, RedisServer, ServerError, ServerSet
from celery_redlock.testing.servers import faketime_library

from .conftest import take

pytestmark = [pytest.mark.one_binary, pytest.mark.timeout(60)]

RATE = 100.0  # masters 2-4's clock speed: a key's TTL lasts 1/RATE of it in real time
DELAY = 0.2  # seconds every request to masters 2-4 waits in its proxy while grant A runs
TTL_A = 2.0  # lives 20 ms on a fast master: well under DELAY
TTL_B = 10.0  # lives 100 ms there: enough for a prompt write-back
# A counter above every master's clock in microseconds (the fast ones gain 99 s per second of
# uptime; this one is the year 2112), and below the 2^53 bound fencing.py refuses.
SEEDED = 2**52
PROMPT, FAST = (0, 1), (2, 3, 4)  # the masters by index: real clock, fast clock


@pytest.fixture
def skewed() -> Iterator[tuple[ServerSet, ServerSet, ProxySet]]:
    try:
        faketime_library()
    except ServerError as exc:
        pytest.skip(str(exc))
    with (
        ServerSet(2) as prompt,
        ServerSet(3, clock_rate=RATE) as fast,
        ProxySet([s.address for s in [*prompt, *fast]], name="fence-minority") as proxies,
    ):
        yield prompt, fast, proxies


def counter_values(servers: Sequence[RedisServer], counter: str) -> list[int | None]:
    values = []
    for server in servers:
        client = server.client()
        try:
            value = client.get(counter)
        finally:
            client.close()
        values.append(None if value is None else int(value))
    return values


def test_a_fence_written_back_to_a_minority_is_refused_so_no_fence_repeats(
    skewed: tuple[ServerSet, ServerSet, ProxySet],
) -> None:
    prompt, fast, proxies = skewed
    servers = [*prompt, *fast]
    with Redlock(proxies.urls, retry_count=0, request_timeout=1.0) as rl:
        # Connections made and both scripts cached everywhere, so each round below is one trip.
        warm = rl.lock("fence-minority-warm", ttl=TTL_B, fenced=True)
        assert take(warm), warm.last_error
        warm.release()

        a = rl.lock("fence-minority", ttl=TTL_A, fenced=True)
        counter = a.key + COUNTER_SUFFIX
        for server in servers:
            client = server.client()
            try:
                client.set(counter, SEEDED)
            finally:
                client.close()

        granted: list[tuple[str, int]] = []
        for i in FAST:
            proxies[i].delay(DELAY, "up")
        acquired_a = a.acquire(blocking=False)
        if acquired_a:
            assert a.fence is not None
            granted.append(("A", a.fence))
        # The scenario happened: every master granted round 1 and read the seed; the fence
        # SEEDED + 1 reached masters 0 and 1 and none of the three whose key had expired.
        assert counter_values(servers, counter) == [SEEDED + 1] * 2 + [SEEDED] * 3
        proxies.heal()
        a.release()

        for i in PROMPT:
            proxies[i].cut()
        b = rl.lock("fence-minority", ttl=TTL_B, fenced=True)
        # B's premise: its rounds end while its key still lives on the fast masters (TTL_B /
        # RATE of real time). An attempt slower than that (a loaded host) is refused by its own
        # key's expiry there, as A is, and is made again; any other refusal fails the test.
        deadline = time.monotonic() + 10
        while not take(b):
            error = b.last_error
            assert error is not None and error.elapsed > TTL_B / RATE, error
            assert time.monotonic() < deadline, f"no attempt of B was fast enough: {error}"
        assert b.fence is not None
        granted.append(("B", b.fence))
        b.release()
        proxies.heal()

    fences = [fence for _, fence in granted]
    assert all(x < y for x, y in itertools.pairwise(fences)), (
        f"fences of successive grants must strictly increase, got {granted}: a fence recorded "
        "on a minority of masters was granted, and a later quorum that missed it issued it again"
    )
    assert not acquired_a, (
        f"grant A's fence was recorded on 2 of 5 masters (quorum 3) and still granted: {a.last_votes}"
    )
    assert granted == [("B", SEEDED + 1)]
