"""Bugs an adversarial review of the lock core found on real servers, one test per bug.

Each test states the invariant it breaks; all of them passed on 0e87348 (the commit before the
connect-path change) and fail on the tree reviewed.

- A master whose connect failed is *down* for its backoff (up to ``BACKOFF_CAP``), and a round
  sends it nothing meanwhile: a release made right after the masters came back is sent to no
  master at all, while every one of them is up and reachable, and the lock stays held for its TTL
  (invariant 2).
- A master with ``MAX_CONNECTING`` connects under way gets nothing from a round that finds no idle
  link: concurrent releases beyond that are silently dropped on healthy masters (invariant 2), and
  concurrent uncontended acquires fail for want of a link.
"""

from __future__ import annotations

import threading
import time

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.resource import Lock
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import keys_on, take, wait_for

# More threads than MAX_CONNECTING (4) plus the one link per master a sequential warm-up leaves.
THREADS = 12


def _run_at_once(targets: list[threading.Thread]) -> None:
    for thread in targets:
        thread.start()
    for thread in targets:
        thread.join(20)
    assert not any(thread.is_alive() for thread in targets), "a lock operation hung"


@pytest.mark.timeout(40)
def test_release_right_after_masters_return_is_not_dropped_during_reconnect_backoff(
    masters: ServerSet,
) -> None:
    """Every master is up and reachable when release() is called, yet it reaches none of them:
    the masters are still *down* from a network blip (their backoff has not run out), so the
    round sends the release on no link, returns in microseconds, and nothing resends it when the
    background reconnect succeeds. Another client cannot acquire for the whole TTL."""
    with (
        ProxySet([server.address for server in masters]) as proxies,
        Redlock(proxies.urls, retry_count=0, ttl=30) as rl,
    ):
        lock = rl.lock("review:release-after-blip")
        assert lock.acquire()
        for proxy in proxies:
            proxy.cut()
        # A blip of ~2 s: every round in it fails to reconnect, and the backoff grows.
        blip_end = time.monotonic() + 2.0
        while time.monotonic() < blip_end:
            assert not lock.extend()
            time.sleep(0.05)
        assert lock.owned()  # a 30 s lock outlives a 2 s blip
        proxies.heal()  # synchronous: every proxy forwards again from here on
        lock.release()
        assert wait_for(lambda: not any(keys_on(masters).values()), 1.0), (
            f"release() returned with every master up, but the key is still held: {keys_on(masters)}"
        )
        with Redlock(masters.urls, retry_count=0) as other:
            assert take(other.lock("review:release-after-blip"))


@pytest.mark.timeout(40)
def test_concurrent_releases_beyond_max_connecting_are_not_dropped(masters: ServerSet) -> None:
    """THREADS locks held through one Redlock (one link per master), released by THREADS threads
    at once on healthy masters: the rounds that find no idle link and MAX_CONNECTING connects
    already under way send their release nowhere, and those locks stay held for their TTL."""
    with Redlock(masters.urls, retry_count=0, ttl=30, request_timeout=0.5) as rl:
        locks = [rl.lock(f"review:burst-release-{k}") for k in range(THREADS)]
        for lock in locks:
            assert lock.acquire()  # one after another: each master keeps a single idle link
        barrier = threading.Barrier(THREADS)

        def release(lock: Lock) -> None:
            barrier.wait(10)
            lock.release()

        _run_at_once([threading.Thread(target=release, args=(lock,)) for lock in locks])
        assert wait_for(lambda: not any(keys_on(masters).values()), 1.0), (
            f"every release() returned on healthy masters, yet keys are left: {keys_on(masters)}"
        )


@pytest.mark.timeout(40)
def test_concurrent_uncontended_acquires_on_healthy_masters_all_succeed(masters: ServerSet) -> None:
    """THREADS threads acquire THREADS different resources at once on a fresh Redlock over
    healthy masters: nobody contends, yet the rounds past MAX_CONNECTING connects per master vote
    error on every master and fail (0e87348: every one succeeded)."""
    with Redlock(masters.urls, retry_count=0, ttl=30, request_timeout=0.5) as rl:
        locks = [rl.lock(f"review:burst-acquire-{k}") for k in range(THREADS)]
        barrier = threading.Barrier(THREADS)
        results: dict[int, bool] = {}

        def acquire(k: int) -> None:
            barrier.wait(10)
            results[k] = locks[k].acquire(blocking=False)

        _run_at_once([threading.Thread(target=acquire, args=(k,)) for k in range(THREADS)])
        failed = {k: str(locks[k].last_error) for k, ok in results.items() if not ok}
        for lock in locks:
            lock.release()
        assert not failed, f"{len(failed)} of {THREADS} uncontended acquires failed: {failed}"
