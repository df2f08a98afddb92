"""RedlockTask on real workers (prefork 2x2 and threads), a real broker and five real masters."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from conftest import contend_while_running, ended_at, holds, records, wait_until

from celery_redlock import Redlock, is_skipped
from celery_redlock.testing import CeleryWorker, Hold, ServerSet, find_overlaps

# CI runs this file on every claimed Python and on the lowest versions (.ci/run, steps 2 and 3).
pytestmark = pytest.mark.versions

Pool = tuple[str, str, list[CeleryWorker]]


@pytest.mark.timeout(60)
def test_duplicates_never_overlap_and_all_run(lockapp: Any, pool: Pool, tag: str) -> None:
    _, queue, _ = pool
    dup, distinct = f"{tag}-dup", [f"{tag}-d{i}" for i in range(3)]
    results = [lockapp.hold.apply_async((dup, 0.25, tag), queue=queue) for _ in range(6)]
    results += [lockapp.hold.apply_async((key, 0.6, tag), queue=queue) for key in distinct]
    for result in results:
        result.get(timeout=45)
    intervals = [r for r in records(lockapp, tag) if r["event"] == "interval"]
    assert sorted(r["key"] for r in intervals) == sorted([dup] * 6 + distinct)
    assert find_overlaps(holds(intervals)) == []
    assert all(r["owned"] for r in intervals)
    # Distinct keys do not wait for each other: at least two of them ran at the same time, so
    # taken as holds of one resource their windows overlap.
    together = [Hold("distinct keys", r["start"], r["end"]) for r in intervals if r["key"] in distinct]
    assert find_overlaps(together), together
    # The duplicates waited by lock retries, never by the task's own retries.
    assert all(r["retries"] == 0 for r in intervals)


@pytest.mark.timeout(60)
def test_skipped_duplicates_are_recorded(lockapp: Any, pool: Pool, tag: str) -> None:
    """A skipped duplicate ends SUCCESS with the skip marker as its value (a terminal state every
    monitor and canvas knows), and only the runs that held the lock recorded an interval."""
    _, queue, _ = pool
    results = [lockapp.hold_or_skip.apply_async((tag, 1.0, tag), queue=queue) for _ in range(4)]
    values = [r.get(timeout=30) for r in results]
    assert all(r.state == "SUCCESS" for r in results)
    skipped = [v for v in values if is_skipped(v)]
    ran = [v for v in values if not is_skipped(v)]
    assert ran and skipped, values
    intervals = records(lockapp, tag)
    assert len(intervals) == len(ran)
    assert find_overlaps(holds(intervals)) == []
    for value in skipped:
        assert value["key"] == f"res:{tag}" and value["reason"] == "held by another run"
        # Who held it: one of the runs that did run.
        assert value["holder"] in {r["task_id"] for r in intervals}
    signalled = [r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]
    assert sum(1 for r in signalled if r["policy"] == "skip") == len(skipped)


@pytest.mark.timeout(60)
def test_long_task_keeps_its_lock(lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]) -> None:
    _, queue, _ = pool
    result = lockapp.long_hold.apply_async((tag, 3.0, tag), queue=queue)  # 5x its 0.6 s TTL
    wait_until(lambda: records(lockapp, tag), 20, "the long task to start")
    attempts, got_in = contend_while_running(result, redlock_master_urls, f"res:{tag}")
    outcome = result.get(timeout=5)
    assert got_in is None or got_in > ended_at(lockapp, tag), "a contender got in while the task ran"
    assert attempts >= 10
    assert outcome["lowest_validity"] > 0


@pytest.mark.timeout(60)
def test_lock_lost_is_seen_by_the_body_and_the_signal(
    lockapp: Any, pool: Pool, tag: str, redlock_masters: ServerSet
) -> None:
    _, queue, _ = pool
    result = lockapp.until_lost.apply_async((tag, 10.0, tag), queue=queue)
    wait_until(lambda: records(lockapp, tag), 20, "the task to start")
    for server in redlock_masters:
        server.flushall()
    seen = result.get(timeout=10)
    assert "lost" in seen
    body = [r for r in records(lockapp, tag) if r["event"] == "seen"]
    assert body and "no longer hold this token" in body[0]["reason"]
    lost = wait_until(
        lambda: [r for r in records(lockapp, "signals:lost") if r["key"] == f"res:{tag}"],
        5,
        "the lock_lost signal",
    )
    assert lost[0]["task_id"] == result.id


@pytest.mark.timeout(60)
def test_a_holder_paused_past_its_ttl_sees_the_loss_on_resume(
    lockapp: Any,
    pool: Pool,
    tag: str,
    redlock_master_urls: list[str],
) -> None:
    """SIGSTOP the process running the body (TTL 1 s) for longer than the TTL: another client
    takes the lock meanwhile, and the resumed body sees the loss before doing anything more."""
    _, queue, _ = pool
    result = lockapp.until_lost.apply_async((tag, 20.0, tag), queue=queue)
    started = wait_until(lambda: records(lockapp, tag), 20, "the task to start")[0]
    with Redlock(redlock_master_urls) as contender:
        lock = contender.lock(f"res:{tag}", ttl=30)
        os.kill(started["pid"], signal.SIGSTOP)
        try:
            assert lock.acquire(timeout=3.0), "the paused holder's lock did not expire"
        finally:
            os.kill(started["pid"], signal.SIGCONT)
        seen = result.get(timeout=15)
        assert "lost" in seen
        body = [r for r in records(lockapp, tag) if r["event"] == "seen"]
        assert body, "the body recorded nothing after resuming"
        # The body's ensure() raised LockLost: the validity ran out while it was stopped.
        assert "validity ran out" in body[0]["lost"], body[0]
        lost = wait_until(
            lambda: [r for r in records(lockapp, "signals:lost") if r["key"] == f"res:{tag}"],
            5,
            "the lock_lost signal",
        )
        assert lost[0]["task_id"] == result.id
        # The resumed holder neither extended nor released the contender's lock.
        assert lock.extend() and lock.owned()
        lock.release()


@pytest.mark.timeout(60)
def test_lock_retries_are_spread_bounded_and_then_fail(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    from celery_redlock import LockNotAcquired

    _, queue, _ = pool
    with Redlock(redlock_master_urls) as holder, holder.lock(f"res:{tag}", ttl=30):
        result = lockapp.bounded.apply_async((tag, tag), queue=queue)
        with pytest.raises(LockNotAcquired) as caught:
            result.get(timeout=30)
    # The JSON result backend rebuilds the exception from its message: check the account there.
    assert "not acquired after 6 attempt(s)" in str(caught.value)
    # Refused by the holder: a quorum of the five said "held" (the holder's acquire promises a
    # quorum, and a master a loaded host made late votes "timeout"), none granted a quorum.
    said = str(caught.value)
    assert said.count(": held") >= len(redlock_master_urls) // 2 + 1, said
    assert said.count(": yes") < len(redlock_master_urls) // 2 + 1, said
    signalled = [r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]
    retries = [r for r in signalled if r["policy"] == "retry"]
    assert [r["attempt"] for r in retries] == [0, 1, 2, 3, 4]
    assert [r["policy"] for r in signalled][-1] == "exhausted"
    countdowns = [r["countdown"] for r in retries]
    # Full jitter: uniform in [0, min(0.2, 0.05 * 2**attempt)].
    for r in retries:
        assert 0.0 <= r["countdown"] <= min(0.2, 0.05 * 2 ** r["attempt"])
    assert len(set(countdowns)) > 1, countdowns
    assert records(lockapp, tag) == []


@pytest.mark.timeout(60)
def test_lock_retries_leave_the_tasks_own_retry_budget(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    _, queue, _ = pool
    with Redlock(redlock_master_urls) as holder:
        lock = holder.lock(f"res:{tag}", ttl=30)
        assert lock.acquire(timeout=5), lock.last_error  # retried: a fresh Redlock connects first
        # own_retry fails at once on contention; hold() retries: use hold() to burn lock retries.
        result = lockapp.hold.apply_async((tag, 0.0, tag), queue=queue)
        wait_until(
            lambda: len([r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]) >= 3,
            20,
            "three lock retries",
        )
        lock.release()
    result.get(timeout=20)
    ran = [r for r in records(lockapp, tag) if r["event"] == "interval"]
    assert [r["retries"] for r in ran] == [0]
    # A task that spends its single own retry: the retried run must find the lock released.
    retried = lockapp.own_retry.apply_async((f"{tag}-own", f"{tag}-own"), queue=queue)
    assert retried.get(timeout=20) == 1
    assert [r["retries"] for r in records(lockapp, f"{tag}-own")] == [0, 1]


@pytest.mark.timeout(60)
def test_the_tasks_own_retry_starts_its_lock_attempts_afresh(
    lockapp: Any,
    pool: Pool,
    tag: str,
    redlock_master_urls: list[str],
) -> None:
    _, queue, _ = pool
    with Redlock(redlock_master_urls) as holder:
        lock = holder.lock(f"res:{tag}", ttl=30)
        assert lock.acquire(timeout=5), lock.last_error  # retried: a fresh Redlock connects first
        result = lockapp.waits_then_retries.apply_async((tag, tag), queue=queue)
        wait_until(
            lambda: len([r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]) >= 2,
            20,
            "two lock retries",
        )
        lock.release()
    assert result.get(timeout=20) == 1
    runs = records(lockapp, tag)
    assert [r["retries"] for r in runs] == [0, 1]
    assert runs[0]["attempt"] >= 2  # the first run got in after lock retries
    assert runs[1]["attempt"] == 0, runs  # its own retry is not charged those lock retries


@pytest.mark.timeout(60)
def test_the_mixin_composes_with_a_base_class_of_its_own(
    lockapp: Any,
    pool: Pool,
    tag: str,
    redlock_master_urls: list[str],
) -> None:
    _, queue, _ = pool
    assert lockapp.mixed.apply_async((tag, tag), queue=queue).get(timeout=20) == tag
    # The result is stored before after_return runs: wait for the base class's hook.
    events = wait_until(
        lambda: [e for e in records(lockapp, tag) if e["event"] == "base-after"] and records(lockapp, tag),
        10,
        "the base class's after_return",
    )
    assert [e["event"] for e in events] == ["base-before", "body", "base-after"]
    assert events[1]["owned"] and events[2]["status"] == "SUCCESS"
    with Redlock(redlock_master_urls) as check:
        # Released as the body ended, its replies received before the result was stored.
        assert not check.lock(f"res:{tag}").locked()


@pytest.mark.timeout(90)
def test_a_finished_run_never_blocks_the_next_run_or_another_client(
    lockapp: Any,
    broker: Any,
    redlock_masters: ServerSet,
    redlock_master_urls: list[str],
    tag: str,
) -> None:
    """One solo worker runs 20 same-key tasks back to back with lock_contended="skip": no run
    finds its predecessor's lock (a skip would show as a missing interval). Then, one run at a
    time, another client (this process) takes the lock without blocking as soon as the run's
    result is in: the release was answered by the masters before the result was stored."""
    from conftest import app_env, start_worker

    queue = f"q-solo-{tag}"
    worker = start_worker(
        app_env(broker.url, broker.url, redlock_master_urls, queue), pool="solo", concurrency=1, queue=queue
    )
    try:
        results = [lockapp.hold_or_skip.apply_async((tag, 0.0, tag), queue=queue) for _ in range(20)]
        values = [r.get(timeout=30) for r in results]
        assert not any(is_skipped(v) for v in values), values
        assert len(records(lockapp, tag)) == 20
        with Redlock(redlock_master_urls, retry_count=0) as other:
            for n in range(5):
                assert lockapp.hold_or_skip.apply_async((tag, 0.0, tag), queue=queue).get(timeout=30) == tag
                lock = other.lock(f"res:{tag}", ttl=5)
                assert lock.acquire(blocking=False), f"run {n}: {[str(v) for v in lock.last_votes]}"
                assert lock.release() is True
    finally:
        worker.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["ignore", "reject"])
def test_a_run_ended_by_ignore_or_reject_releases_its_lock(
    lockapp: Any,
    pool: Pool,
    tag: str,
    redlock_master_urls: list[str],
    how: str,
) -> None:
    """Ignore and Reject from the body skip after_return; the task_postrun hook releases the
    lock instead, long before its 5 s TTL would."""
    _, queue, _ = pool
    lockapp.gives_up.apply_async((tag, how, tag), queue=queue)
    wait_until(lambda: records(lockapp, tag), 30, "the run to take its lock")
    taken = time.monotonic()
    with Redlock(redlock_master_urls) as check:
        lock = check.lock(f"res:{tag}", ttl=5.0)
        assert lock.acquire(timeout=3.0), f"the {how}d run's lock was left to expire"
        assert time.monotonic() - taken < 3.0
        lock.release()
