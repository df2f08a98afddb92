"""Hold order of fences with a slow grant overlapping a fast one, on real masters.

The rule attacked (fencing.py, "What each rule is for"): the counter is read inside the
acquiring script. Read in a step of its own before the SET, a whole grant by another client can
fit between the reading and the SET: that grant's hold ends, ours begins, and ours carries a
fence computed before the other's existed (the same or lower). The real-time check of
test_fencing.py does not see it, because the two calls overlap; the hold order does: of two
grants whose holds are disjoint, the later hold has the larger fence.

Found by the mutation run (tests/mutations): with the reading moved out of the script, the only
failing test counted the rounds a fenced grant costs.

Scenario: client X reaches every master through a proxy that holds each request ``DELAY`` on
the way up; client Y reaches them directly. Once X's first request is held at every proxy, Y
waits 1.5 x ``DELAY``, then takes the lock and releases it. As built, X's first request is its
acquiring script, which lands ``DELAY`` after it was held: Y finds X holding and is refused (or,
on a machine slow enough to shift that, Y's hold comes first and X reads Y's fence). A reading
sent before the SET lands at ``DELAY``, X's SET only at ``2 x DELAY``: Y's whole grant fits in
between, and X's later hold carries a smaller fence than Y's.
"""

from __future__ import annotations

import threading
import time

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import take

pytestmark = [pytest.mark.one_binary, pytest.mark.timeout(60)]

DELAY = 0.6  # seconds each of X's requests waits in its proxy
NAME = "fence-hold-order"


def test_a_later_hold_carries_the_larger_fence_when_the_grants_overlap(masters: ServerSet) -> None:
    with (
        ProxySet([server.address for server in masters], name="slow-x") as proxies,
        Redlock(proxies.urls, retry_count=0, request_timeout=4 * DELAY) as slow,
        Redlock(masters.urls, retry_count=0) as fast,
    ):
        for client in (slow, fast):  # connections made and the scripts cached: one trip per round
            warm = client.lock(NAME + "-warm", ttl=5, fenced=True)
            assert take(warm), warm.last_error
            warm.release()

        x = slow.lock(NAME, ttl=10, fenced=True)
        x_result: list[bool] = []
        x_returned: list[float] = []

        def take_x() -> None:
            x_result.append(x.acquire(blocking=False))
            x_returned.append(time.monotonic())

        for proxy in proxies:
            proxy.delay(DELAY, "up")
        thread = threading.Thread(target=take_x, name="slow-x", daemon=True)
        thread.start()
        deadline = time.monotonic() + 5
        while not all(proxy.pending() for proxy in proxies):
            assert time.monotonic() < deadline, "X's first request never reached the proxies"
            time.sleep(0.002)
        held = time.monotonic()
        time.sleep(max(0.0, held + 1.5 * DELAY - time.monotonic()))  # the scenario's timing

        y = fast.lock(NAME, ttl=10, fenced=True)
        y_acquired = y.acquire(blocking=False)
        y_fence = y.fence
        if y_acquired:
            assert y.release()
        y_released = time.monotonic()

        thread.join(10 * DELAY)
        assert not thread.is_alive(), "X's acquire did not return"
        proxies.heal()
        assert x_result == [True], x.last_error
        x_fence = x.fence
        x.release()

    assert x_fence is not None
    if y_acquired:
        assert y_fence is not None
        # Y's release returned before X's acquire did, and X held its key at its write-back:
        # X's hold on the masters they share came after Y's, so its fence must be larger.
        assert y_released < x_returned[0]
        assert x_fence > y_fence, (
            f"X's hold began after Y's ended, yet X's fence {x_fence} is not above Y's {y_fence}: "
            "X's counter was read before its SET"
        )
