"""Every way Celery runs a locked task keeps the lock's promise (issue #14, items 1 to 4).

Properties, each attacked on real masters, a real broker and (where a worker decides) real
workers:

- an eager run (``apply()``, ``task_always_eager``) never publishes, and a contended one waits
  in-process within its lock-retry budget (one lock TTL with none), then ends as the mode says;
- a body that calls ``self.retry()`` holds its lock until it has actually ended: a fallback on
  ``MaxRetriesExceededError`` and a body going on after ``retry(throw=False)`` run locked;
- a lock held by an earlier attempt of the same task id (a pool process killed holding it, the
  message redelivered) never makes that task's copy skip or fail: it waits, then runs;
- a skip is a finished run: SUCCESS with the skip marker as its value, a task-succeeded event, a
  chord that completes and a chain that goes on with the marker, and no result stored under
  ``ignore_result``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord
from conftest import records, wait_until

from celery_redlock import LockNotAcquired, Redlock, RedlockTask, is_skipped
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import CeleryWorker, RedisServer

Pool = tuple[str, str, list[CeleryWorker]]


# -- 1. eager calls ---------------------------------------------------------------------------------
@pytest.fixture
def eager_app(broker: RedisServer, redlock_master_urls: list[str]) -> Iterator[Celery]:
    app = Celery("eager", broker=broker.url, set_as_current=False)
    app.conf.update(
        redlock_masters=redlock_master_urls,
        redlock_retry_backoff=0.05,
        redlock_retry_backoff_max=0.2,
        task_default_queue="eager-never-used",
    )
    yield app
    close_app_redlock(app)


def published(broker: RedisServer) -> int:
    """Messages waiting on the queue an eager call would publish a lock retry to."""
    client = redis.Redis.from_url(broker.url)
    try:
        return int(client.llen("eager-never-used"))
    finally:
        client.close()


def define(app: Celery, name: str, ran: list[int], **options: Any) -> Any:
    @app.task(base=RedlockTask, lock_key="eager:<n>", name=name, lazy=False, shared=False, **options)
    def locked(n: int) -> int:
        ran.append(n)
        return n

    return locked


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["apply", "always_eager"])
def test_a_contended_eager_run_waits_in_process_and_never_publishes(
    eager_app: Celery, broker: RedisServer, redlock_master_urls: list[str], mode: str
) -> None:
    ran: list[int] = []
    task = define(eager_app, f"eager.bounded.{mode}", ran, lock_max_retries=4)
    eager_app.conf.task_always_eager = mode == "always_eager"
    call = task.apply if mode == "apply" else (lambda args: task.delay(*args))
    with Redlock(redlock_master_urls) as other:
        holder = other.lock("eager:1", ttl=10)
        assert holder.acquire(timeout=5), holder.last_error  # retried: a fresh Redlock connects first
        started = time.monotonic()
        result = call((1,))
        # Four in-process retries of at most 0.2 s each, then the budget's own end.
        assert time.monotonic() - started < 2.0
        assert result.state == "FAILURE" and isinstance(result.result, LockNotAcquired), result.result
        assert result.result.attempts == 5
        assert ran == []
        # Released while a call with a larger budget waits: it gets in and runs, locked.
        patient = define(eager_app, f"eager.patient.{mode}", ran, lock_max_retries=100)
        call = patient.apply if mode == "apply" else (lambda args: patient.delay(*args))
        threading.Timer(0.3, holder.release).start()
        assert call((1,)).get() == 1
        assert ran == [1]
    assert published(broker) == 0  # not one lock retry went to the broker


@pytest.mark.timeout(30)
def test_an_eager_run_with_no_retry_budget_waits_one_ttl_at_most(
    eager_app: Celery, redlock_master_urls: list[str]
) -> None:
    """Unbounded lock retries would hang a test suite on a lock nobody releases; an eager run
    waits one lock TTL at most (no RecursionError, no endless loop)."""
    ran: list[int] = []
    task = define(eager_app, "eager.unbounded", ran, lock_ttl=1.0)
    eager_app.conf.task_always_eager = True
    with Redlock(redlock_master_urls) as other:
        holder = other.lock("eager:2", ttl=10)
        assert holder.acquire(timeout=5), holder.last_error  # retried: a fresh Redlock connects first
        started = time.monotonic()
        result = task.delay(2)
        assert time.monotonic() - started < 1.5
        assert isinstance(result.result, LockNotAcquired)
        holder.release()
    assert ran == []


@pytest.mark.timeout(30)
def test_an_eager_skip_returns_the_marker(eager_app: Celery, redlock_master_urls: list[str]) -> None:
    ran: list[int] = []
    task = define(eager_app, "eager.skip", ran, lock_contended="skip")
    with Redlock(redlock_master_urls) as other, other.lock("eager:3", ttl=10):
        value = task.apply((3,)).get()
    assert is_skipped(value) and value["key"] == "eager:3" and ran == []
    assert task.apply((3,)).get() == 3  # free again: it runs


# -- 2. the task's own retry keeps the lock until the body ends -------------------------------------
@pytest.mark.timeout(60)
def test_a_fallback_after_max_retries_runs_under_the_lock(lockapp: Any, pool: Pool, tag: str) -> None:
    _, queue, _ = pool
    assert lockapp.retry_fallback.apply_async((tag, tag), queue=queue).get(timeout=20) == "fallback"
    (seen,) = records(lockapp, tag)
    assert seen["owned"] and not seen["free"], seen


@pytest.mark.timeout(60)
def test_a_body_that_goes_on_after_retry_without_throw_holds_the_lock(
    lockapp: Any, pool: Pool, tag: str
) -> None:
    _, queue, _ = pool
    lockapp.retry_no_throw.apply_async((tag, tag), queue=queue)
    seen = wait_until(lambda: len(records(lockapp, tag)) == 2 and records(lockapp, tag), 20, "both runs")
    after = next(r for r in seen if r["event"] == "after-retry")
    assert after["owned"] and not after["free"], after
    assert [r["event"] for r in seen].count("retried") == 1  # the retried copy ran, once


# -- 3. a redelivered copy of a crashed run ----------------------------------------------------------
@pytest.mark.timeout(90)
def test_a_redelivered_copy_of_a_crashed_run_waits_and_runs(
    lockapp: Any, worker_pools: dict[str, tuple[str, list[CeleryWorker]]], tag: str
) -> None:
    """acks_late + reject_on_worker_lost + skip: the pool process dies holding the lock, the
    broker redelivers the same task id, and the copy finds the dead run's lock. It is this very
    task's earlier attempt, not a duplicate: the copy waits for the lock to expire, then runs."""
    queue, workers = worker_pools["prefork"]
    result = lockapp.crash_once.apply_async((tag, tag), queue=queue)
    assert result.get(timeout=60) == "done"
    runs = records(lockapp, tag)
    assert [r["first"] for r in runs] == [True, False], runs
    assert runs[0]["task_id"] == runs[1]["task_id"] == result.id
    # The copy found the lock held and waited (lock retries), never skipped.
    contended = [r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]
    assert contended and all(r["policy"] == "retry" for r in contended), contended
    for worker in workers:
        assert worker.running


# -- 4. skips in canvas and monitoring --------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_skip_is_a_success_with_a_terminal_event(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    """SUCCESS in the backend, and the worker's success path: the one that sends task-succeeded
    (Flower would otherwise show the run STARTED forever), seen in the worker's own log line."""
    _, queue, workers = pool
    with Redlock(redlock_master_urls) as other, other.lock(f"res:{tag}", ttl=20):
        result = lockapp.hold_or_skip.apply_async((tag, 0.0, tag), queue=queue)
        value = result.get(timeout=20)
    assert result.state == "SUCCESS" and is_skipped(value), value
    assert value["holder"] is None  # taken by a plain client, not a task
    wait_until(
        lambda: any(f"[{result.id}] succeeded" in w.log_text() for w in workers),
        10,
        "the worker's success line for the skipped run",
    )


@pytest.mark.timeout(60)
def test_a_skipped_chord_member_lets_the_chord_complete(lockapp: Any, pool: Pool, tag: str) -> None:
    _, queue, _ = pool
    header = [lockapp.hold_or_skip.si(tag, 1.0, tag).set(queue=queue) for _ in range(2)]
    result = chord(header)(lockapp.collect.s().set(queue=queue))
    values = result.get(timeout=30)
    assert len(values) == 2 and sum(1 for v in values if is_skipped(v)) >= 1, values


@pytest.mark.timeout(60)
def test_a_chain_goes_on_with_the_marker_of_a_skipped_link(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    _, queue, _ = pool
    with Redlock(redlock_master_urls) as other, other.lock(f"res:{tag}", ttl=20):
        result = chain(
            lockapp.hold_or_skip.si(tag, 0.0, tag).set(queue=queue), lockapp.collect.s().set(queue=queue)
        ).apply_async()
        value = result.get(timeout=20)
    assert is_skipped(value) and value["key"] == f"res:{tag}", value


@pytest.mark.timeout(60)
def test_a_skip_stores_no_result_under_ignore_result(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    _, queue, _ = pool
    with Redlock(redlock_master_urls) as other, other.lock(f"res:{tag}", ttl=20):
        result = lockapp.skip_quietly.apply_async((tag, tag), queue=queue)
        wait_until(
            lambda: any(
                r["key"] == f"res:{tag}" and r["policy"] == "skip"
                for r in records(lockapp, "signals:contended")
            ),
            20,
            "the skip",
        )
    # The run has ended (the hook fired in the run); give the backend a moment to be written
    # if it were going to be, then check nothing was.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert result.state == "PENDING", result.state
        time.sleep(0.05)
    assert records(lockapp, tag) == []


@pytest.mark.timeout(30)
def test_a_base_with_its_own_call_wrapper_still_wraps_every_run(
    eager_app: Celery, redlock_master_urls: list[str]
) -> None:
    """RedlockTask defines __call__ (for the skip marker); a user's base that wraps every run of
    the body in a __call__ of its own must still be called. (A skip runs no user code at all: it
    returns the marker, unwrapped.)"""
    from celery import Task

    from celery_redlock import RedlockTaskMixin

    class Wrapped(Task):  # type: ignore[misc]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return ["wrapped", super().__call__(*args, **kwargs)]

    class Mine(RedlockTaskMixin, Wrapped):
        abstract = True

    @eager_app.task(base=Mine, lock_key="wrapped:<n>", name="eager.wrapped", lazy=False, shared=False)
    def job(n: int) -> int:
        return n

    assert job.apply((4,)).get() == ["wrapped", 4]
    assert job(5) == ["wrapped", 5]  # a direct call: the plain function, through the wrapper


@pytest.mark.timeout(30)
def test_a_skip_runs_no_body_even_under_a_subclass_call_that_calls_run(
    eager_app: Celery, redlock_master_urls: list[str]
) -> None:
    """Found by review: a subclass whose own __call__ calls ``self.run`` comes before the mixin's
    __call__ in the MRO, so a skipped run executed its body unlocked (4 bodies at once on real
    workers). A skip must never reach user code that runs the body."""

    class Runs(RedlockTask):  # type: ignore[misc]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

    ran: list[int] = []

    @eager_app.task(
        base=Runs, lock_key="runs:<n>", lock_contended="skip", name="eager.runs", lazy=False, shared=False
    )
    def job(n: int) -> int:
        ran.append(n)
        return n

    with Redlock(redlock_master_urls) as other, other.lock("runs:1", ttl=10):
        value = job.apply((1,)).get()
    assert is_skipped(value) and ran == [], (value, ran)
    assert job.apply((1,)).get() == 1 and ran == [1]  # free: it runs, through the subclass's call


@pytest.mark.timeout(30)
def test_a_direct_call_inside_a_locked_body_gets_its_own_arguments(
    eager_app: Celery, redlock_master_urls: list[str]
) -> None:
    """Found by review: a direct (recursive) call of the task from its own locked body saw the
    outer run's request (its args), where plain Celery gives the inner call a request of its own."""
    seen: list[tuple[int, Any]] = []

    @eager_app.task(bind=True, base=RedlockTask, lock_key="rec", name="eager.rec", lazy=False, shared=False)
    def rec(self: RedlockTask, n: int) -> int:
        seen.append((n, tuple(self.request.args or ())))
        return rec(n - 1) if n else 0

    assert rec.apply((1,)).get() == 0
    assert seen == [(1, (1,)), (0, (0,))], seen
