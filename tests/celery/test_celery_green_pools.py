"""RedlockTask on real gevent and eventlet workers (``-P gevent``, ``-P eventlet``): a real
broker, five real masters, and two worker processes per pool, so a lock is contended both
between green threads of one process and between processes.

Both libraries monkey-patch the standard library at worker start: they replace ``select.poll``,
which the lock core waits with (eventlet deletes it; see ``celery_redlock.lock.waiting``), and
every thread of the core (the heartbeat among them) becomes a green thread. Bodies that wait on
I/O (``time.sleep`` here) let the heartbeat run; a CPU-bound body that never yields does not, and
its lock expires under it: the tests show both, as docs/pools.md says.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    RUN,
    app_env,
    contend_while_running,
    ended_at,
    holds,
    records,
    start_worker,
    wait_until,
    woken_by_release,
)

from celery_redlock import Redlock
from celery_redlock.testing import CeleryWorker, Hold, RedisServer, ServerSet, find_overlaps

pytest.importorskip("gevent")
pytest.importorskip("eventlet")

GREEN_POOLS = ["gevent", "eventlet"]
WORKERS = 2
CONCURRENCY = 8

Pool = tuple[str, str, list[CeleryWorker]]


@pytest.fixture(scope="module", params=GREEN_POOLS)
def green_pool(
    request: pytest.FixtureRequest, lockapp: Any, broker: RedisServer, _redlock_server_set: ServerSet
) -> Iterator[Pool]:
    """(pool name, its queue, its running workers): started once per pool for this module."""
    pool = request.param
    queue = f"q-{pool}-{RUN}"
    env = app_env(broker.url, broker.url, _redlock_server_set.urls, queue)
    workers: list[CeleryWorker] = []
    try:
        for _ in range(WORKERS):
            workers.append(start_worker(env, pool=pool, concurrency=CONCURRENCY, queue=queue))
        yield pool, queue, workers
    finally:
        for worker in workers:
            worker.cleanup()


@pytest.fixture
def pool(green_pool: Pool, redlock_masters: ServerSet) -> Pool:
    """The module's workers, checked alive, with the masters reset for the test."""
    for worker in green_pool[2]:
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return green_pool


# Run in a fresh interpreter patched by argv[1]: take and release a lock (its links are then
# idle, each owing the release's reply), have every master close them, and take it again.
CLOSED_LINKS = """
import json, sys
if sys.argv[1] == "eventlet":
    import eventlet
    eventlet.monkey_patch()
else:
    from gevent import monkey
    monkey.patch_all()
import redis
from celery_redlock import Redlock

urls = [f"{url}?client_name=green-check" for url in sys.argv[2].split(",")]
# A closed link written to votes "error"; request_timeout 2 s keeps a loaded host's slow
# reconnects from voting "timeout" (the subject is the replacement, not its speed).
with Redlock(urls, request_timeout=2.0) as redlock:
    lock = redlock.lock(sys.argv[3], ttl=5)
    assert lock.acquire(blocking=False), [str(v) for v in lock.last_votes]
    lock.release()
    for url in sys.argv[2].split(","):
        admin = redis.Redis.from_url(url)
        for client in admin.client_list():
            if client["name"] == "green-check":
                admin.client_kill_filter(_id=client["id"])
        admin.close()
    lock = redlock.lock(sys.argv[3], ttl=5)
    lock.acquire(blocking=False)
    print(json.dumps([v.kind for v in lock.last_votes]))
    lock.release()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("library", GREEN_POOLS)
def test_idle_links_the_masters_closed_are_replaced_under_patching(
    library: str, tmp_path: Path, tag: str, redlock_master_urls: list[str]
) -> None:
    """A round checks its idle links before writing to them. gevent's poll reports a closed
    connection only as readable, and the release reply that arrived before the close hides it;
    under patching the check goes to the real poll (POLLRDHUP), so every closed link is replaced
    within the round and every master grants, where a write to the dead link would vote error."""
    script = tmp_path / "closed_links.py"
    script.write_text(CLOSED_LINKS)
    done = subprocess.run(
        [sys.executable, str(script), library, ",".join(redlock_master_urls), f"closed-{tag}"],
        capture_output=True,
        text=True,
        timeout=45,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["yes"] * len(redlock_master_urls)


def _no_errors_logged(workers: list[CeleryWorker]) -> None:
    """No task failed, and no traceback passed through this package: a failure inside the core
    (a missing select.poll, a blocked hub) shows in the log first. Other tracebacks are not ours
    to judge: under gevent, Celery's own ``AsyncResult.__del__`` (for the message a lock retry
    publishes) may be collected inside the hub and log "Exception ignored" when it connects."""
    for worker in workers:
        text = worker.log_text()
        for sign in ("raised unexpected", "/celery_redlock/"):
            assert sign not in text, f"{worker!r} logged an error:\n{worker.log_tail()}"


@pytest.mark.timeout(90)
def test_locked_tasks_run_and_duplicates_never_overlap(lockapp: Any, pool: Pool, tag: str) -> None:
    _, queue, workers = pool
    dup, distinct = f"{tag}-dup", [f"{tag}-d{i}" for i in range(4)]
    results = [lockapp.hold.apply_async((dup, 0.2, tag), queue=queue) for _ in range(8)]
    results += [lockapp.hold.apply_async((key, 0.6, tag), queue=queue) for key in distinct]
    for result in results:
        result.get(timeout=60)
    intervals = [r for r in records(lockapp, tag) if r["event"] == "interval"]
    assert sorted(r["key"] for r in intervals) == sorted([dup] * 8 + distinct)
    assert find_overlaps(holds(intervals)) == []
    assert all(r["owned"] for r in intervals)
    # Distinct keys did not wait for each other; the duplicates waited by lock retries, never
    # by the task's own.
    together = [Hold("distinct keys", r["start"], r["end"]) for r in intervals if r["key"] in distinct]
    assert find_overlaps(together), together
    assert all(r["retries"] == 0 for r in intervals)
    _no_errors_logged(workers)


@pytest.mark.timeout(90)
def test_wait_mode_duplicates_are_woken_by_the_release(lockapp: Any, pool: Pool, tag: str) -> None:
    """lock_contended="wait" under a green pool: 8 green threads per worker wait on one name,
    the subscriber thread is a green thread too, and each waiter is woken by a release (the
    task's fallback retry backoff is 5 s, so a run that fell back would show)."""
    _, queue, workers = pool
    results = [lockapp.hold_or_wait.apply_async((tag, 0.1, tag), queue=queue) for _ in range(10)]
    for result in results:
        result.get(timeout=60)
    intervals = sorted(records(lockapp, tag), key=lambda r: r["start"])
    assert len(intervals) == 10
    assert find_overlaps(holds(intervals)) == []
    assert all(r["owned"] for r in intervals)
    assert woken_by_release(lockapp, tag, intervals) == []
    gaps = sorted(b["start"] - a["end"] for a, b in itertools.pairwise(intervals))
    assert gaps[len(gaps) // 2] < 0.25, gaps
    _no_errors_logged(workers)


@pytest.mark.timeout(90)
def test_an_io_bound_body_keeps_its_lock_past_its_ttl(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    """``long_hold`` sleeps in small steps for 5x its 0.6 s TTL: the heartbeat green thread runs
    whenever the body sleeps, and no contender gets in meanwhile."""
    _, queue, workers = pool
    result = lockapp.long_hold.apply_async((tag, 3.0, tag), queue=queue)
    wait_until(lambda: records(lockapp, tag), 30, "the long task to start")
    attempts, got_in = contend_while_running(result, redlock_master_urls, f"res:{tag}")
    outcome = result.get(timeout=5)
    assert got_in is None or got_in > ended_at(lockapp, tag), "a contender got in while the task ran"
    assert attempts >= 10
    assert outcome["lowest_validity"] > 0
    _no_errors_logged(workers)


def _spin_while_contending(lockapp: Any, queue: str, tag: str, urls: list[str], pause: float) -> str:
    """Run ``spin`` (2.5 s, 2.5x its TTL) yielding every 20 ms with ``time.sleep(pause)``, trying
    to take its lock throughout: the verdict is that of the body ("" if it kept the lock), or
    the contender's if it got in before the body ended.

    The run's lock is released before its result can be seen, so a contender may get in after
    the body ended and before ``result.ready()``: that is the release, not a loss. The body
    records when it ended (the same monotonic clock as this process), and only a contender that
    got in before then counts."""
    result = lockapp.spin.apply_async((tag, 2.5, 0.02, pause, tag), queue=queue)
    wait_until(lambda: records(lockapp, tag), 30, "the spinning task to start")
    attempts, got_in = contend_while_running(result, urls, f"res:{tag}")
    lost: str = result.get(timeout=15)  # and the next test finds the worker idle
    ended = ended_at(lockapp, tag)
    if got_in is not None and got_in < ended:
        return f"a contender got in after {attempts} attempts, {ended - got_in:.3f} s before the body ended"
    assert attempts >= 10
    return lost


@pytest.mark.timeout(90)
def test_a_cpu_bound_body_that_never_yields_loses_its_lock(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    """``spin`` keeps the CPU for 2.5x its 1 s TTL without yielding: the heartbeat cannot run,
    the lock expires on the masters and a contender takes it; the body's ``ensure()`` then
    raises LockLost (validity ran out), and the heartbeat, once it runs again, logs that it was
    starved."""
    _, queue, workers = pool
    logged = {w.name: len(w.log_text()) for w in workers}  # what this test's run adds is read
    result = lockapp.spin.apply_async((tag, 2.5, 0.0, 0.0, tag), queue=queue)
    started = wait_until(lambda: records(lockapp, tag), 30, "the spinning task to start")[0]
    with Redlock(redlock_master_urls) as contender:
        lock = contender.lock(f"res:{tag}", ttl=30)
        assert lock.acquire(timeout=5.0), "the spinning holder's lock did not expire"
        took = time.clock_gettime(time.CLOCK_MONOTONIC)
        # The body held it until its TTL ran out (1 s, less the drift allowance), not less.
        assert took - started["start"] >= 0.9
        lost = result.get(timeout=15)
        assert "validity ran out" in lost, lost
        end = next(r for r in records(lockapp, tag) if r["event"] == "end")
        assert end["end"] > took, "the body had ended before the contender got in"
        # The worker's heartbeat, running again once the body ended, neither extended nor
        # released the contender's lock.
        assert lock.extend() and lock.owned()
        lock.release()
    reported = wait_until(
        lambda: [w for w in workers if "lock heartbeat ran" in w.log_text()[logged[w.name] :]],
        10,
        "the heartbeat's report that it was starved",
    )
    # Only the worker that ran the body was starved.
    assert len(reported) == 1, [w.log_tail() for w in reported]


@pytest.mark.timeout(90)
def test_a_cpu_bound_body_that_sleeps_briefly_keeps_its_lock(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    """The same body sleeping 1 ms every 20 ms, far more often than ttl/3: the heartbeat runs in
    those gaps and the lock outlives its TTL, uncontended, under either library."""
    _, queue, workers = pool
    assert _spin_while_contending(lockapp, queue, tag, redlock_master_urls, pause=0.001) == ""
    _no_errors_logged(workers)


@pytest.mark.timeout(90)
def test_sleep_zero_lets_the_heartbeat_run_under_eventlet_but_not_under_gevent(
    lockapp: Any, pool: Pool, tag: str, redlock_master_urls: list[str]
) -> None:
    """``sleep(0)`` every 20 ms: eventlet's runs its hub, timers included, so the heartbeat runs
    and the lock is kept. gevent's lets runnable greenlets run but delays its timers several-fold
    once the body runs longer than gevent's switch interval (5 ms) between yields: the heartbeat,
    which waits on timers, falls behind and the lock is lost as if the body never yielded. Hence
    the README's advice: under gevent, yield with a sleep longer than 0."""
    name, queue, _ = pool
    verdict = _spin_while_contending(lockapp, queue, tag, redlock_master_urls, pause=0.0)
    if name == "eventlet":
        assert verdict == ""
    else:
        assert verdict.startswith("a contender got in"), verdict
