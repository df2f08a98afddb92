"""Every way a run ends releases its lock, once, on real servers and real workers (a threads worker of
concurrency 4, a prefork worker of concurrency 2) and eagerly in this process.

A run's lock (TTL 30 s) must be obtainable by another Redlock client right after the run is
seen to end (its result stored, or its body's ``end`` record for a run that stores none), and
the worker must never log a release "not confirmed by a quorum" (a second release of a lock
already released)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import CeleryWorker
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

TWICE = "not confirmed by a quorum"


def free_now(contender: Redlock, key: str) -> bool:
    lock = contender.lock(f"r46:{key}", ttl=5)
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def free_within(contender: Redlock, key: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if free_now(contender, key):
            return True
        time.sleep(0.05)
    return False


def ended(r46: Any, key: str, count: int = 1, seconds: float = 30) -> None:
    def done() -> bool:
        return sum(e["event"] == "end" for e in r46.events(key)) >= count

    wait_until(done, seconds, f"{count} run(s) of {key} to end")


def no_double_release(worker: CeleryWorker) -> None:
    text = worker.log_text()
    assert TWICE not in text, worker.log_tail()


@pytest.mark.parametrize("pool", ["threads", "prefork"])
@pytest.mark.parametrize("how", ["ok", "boom", "own_retry", "replaced"])
def test_a_run_with_a_result_releases_before_it_is_seen(
    r46: Any, threads46: Any, prefork46: Any, contender: Redlock, pool: str, how: str
) -> None:
    worker, queue = threads46 if pool == "threads" else prefork46
    key = f"{how}-{uuid.uuid4().hex[:8]}"
    result = getattr(r46, how).apply_async((key,), queue=queue)
    result.get(timeout=30, propagate=False)
    expected = {"ok": "SUCCESS", "boom": "FAILURE", "own_retry": "SUCCESS", "replaced": "SUCCESS"}[how]
    assert result.state == expected
    assert free_now(contender, key), f"{how}: the lock was still held when the result was stored"
    if how == "own_retry":
        assert [e["retries"] for e in r46.events(key) if e["event"] == "end"] == [0, 1]
    no_double_release(worker)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
@pytest.mark.parametrize("how", ["ignored", "rejected"])
def test_an_ignored_or_rejected_run_releases(
    r46: Any, threads46: Any, prefork46: Any, contender: Redlock, pool: str, how: str
) -> None:
    worker, queue = threads46 if pool == "threads" else prefork46
    key = f"{how}-{uuid.uuid4().hex[:8]}"
    getattr(r46, how).apply_async((key,), queue=queue)
    ended(r46, key)
    assert free_within(contender, key, 3.0), f"{how}: the lock was not released (TTL 30 s)"
    no_double_release(worker)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_lock_retry_releases_after_it_gets_in(
    r46: Any, threads46: Any, prefork46: Any, contender: Redlock, pool: str
) -> None:
    worker, queue = threads46 if pool == "threads" else prefork46
    key = f"contended-{uuid.uuid4().hex[:8]}"
    holder = contender.lock(f"r46:{key}", ttl=30)
    assert holder.acquire(blocking=False)
    result = r46.contended.apply_async((key,), queue=queue)
    wait_until(lambda: result.state == "RETRY", 20, "a lock retry")
    assert holder.release()
    assert result.get(timeout=30) == key
    assert free_now(contender, key)
    no_double_release(worker)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_run_refused_after_acquiring_is_released_by_after_return(
    r46: Any, threads46: Any, prefork46: Any, contender: Redlock, pool: str
) -> None:
    """before_start took the lock and then raised: no body ran, the tracer never called the
    task; after_return (or task_postrun) is all that releases."""
    worker, queue = threads46 if pool == "threads" else prefork46
    key = f"refused-{uuid.uuid4().hex[:8]}"
    result = r46.refused.apply_async((key,), queue=queue)
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    assert free_within(contender, key, 3.0), "the refused run's lock was not released (TTL 30 s)"
    wait_until(lambda: len(r46.events(key)) >= 2, 20, "the postrun record")
    # after_return released it, before task_postrun (the last backstop) began.
    assert [(e["event"], e.get("held")) for e in r46.events(key)] == [("acquired", None), ("postrun", False)]
    no_double_release(worker)


def test_one_task_id_published_twice_on_the_threads_pool(
    r46: Any, threads46: Any, contender: Redlock
) -> None:
    """The same task id twice, same arguments (the same key): the runs take turns, and the
    lock is free once both ended."""
    worker, queue = threads46
    key = f"twice-{uuid.uuid4().hex[:8]}"
    fixed = uuid.uuid4().hex
    r46.ok.apply_async((key, 0.5), task_id=fixed, queue=queue)
    r46.ok.apply_async((key, 0.5), task_id=fixed, queue=queue)
    ended(r46, key, 2)
    assert free_within(contender, key, 3.0)
    spans = [e for e in r46.events(key) if e["event"] in ("start", "end")]
    assert [e["event"] for e in spans] == ["start", "end", "start", "end"], spans
    no_double_release(worker)


@pytest.mark.parametrize("how", ["ok", "boom", "refused", "replaced"])
def test_an_eager_apply_releases(r46: Any, contender: Redlock, how: str) -> None:
    key = f"eager-{how}-{uuid.uuid4().hex[:8]}"
    result = getattr(r46, how).apply((key,))
    assert result.state in ("SUCCESS", "FAILURE", "IGNORED")
    assert free_now(contender, key), f"eager {how}: the lock was still held after apply()"


def test_revoke_with_terminate_releases_once(r46: Any, prefork46: Any, contender: Redlock) -> None:
    worker, queue = prefork46
    key = f"revoked-{uuid.uuid4().hex[:8]}"
    result = r46.ok.apply_async((key, 60.0), queue=queue)
    wait_until(lambda: r46.events(key), 20, "the run to start")
    assert not free_now(contender, key)
    r46.app.control.revoke(result.id, terminate=True)
    assert free_within(contender, key, 5.0), "the terminated run's lock was not released (TTL 30 s)"
    no_double_release(worker)
