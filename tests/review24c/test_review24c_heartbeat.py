"""``lock_lost`` is announced once, and only for a lock that is lost: forgetting a kept lock
that is still owned (the usual end of a run, or ``Heartbeat.forget`` before ``release``, as its
docstring allows) announces nothing. Three real masters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.testing import ServerSet

from ..core.conftest import take


@pytest.fixture(scope="module")
def three() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.mark.timeout(30)
def test_forgetting_a_kept_lock_still_owned_announces_no_loss(three: ServerSet) -> None:
    calls: list[str] = []
    beat = Heartbeat(name="r24-heartbeat")
    try:
        with Redlock(three.urls, retry_count=0) as rl:
            lock = rl.lock("r24-forget-owned", ttl=2.0)
            assert take(lock)
            beat.keep(lock, on_lost=lambda _lock, reason: calls.append(reason))
            assert lock.owned()
            beat.forget(lock)  # before the release, as a run's end does
            assert lock.owned()
            assert lock.release()
            assert calls == [], f"a lock forgotten while owned was announced lost: {calls}"
    finally:
        beat.stop()
