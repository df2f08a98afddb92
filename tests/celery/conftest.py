"""Real workers for the Celery tests: a broker server of its own, five lock masters, and worker
processes shared per session (one pair of prefork workers, one threads worker), each consuming
a queue of its own so a test picks the pool by the queue it sends to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redlock.testing import CeleryWorker, Hold, RedisServer, ServerSet
from celery_redlock.testing.celery import stop_all
from tests.onmasters import pttls as pttls  # the Celery tests import it from here
from tests.waiting import wait_for as wait_for  # the Celery tests import it from here
from tests.waiting import wait_until as wait_until  # the Celery tests import it from here

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def lockapp(broker: RedisServer, _redlock_server_set: ServerSet) -> Any:
    """The test process's side of ``lockapp``, configured like the workers."""
    env = app_env(broker.url, broker.url, _redlock_server_set.urls)
    os.environ.update(env)
    import lockapp as module

    module.app.conf.update(
        broker_url=broker.url, result_backend=broker.url, redlock_masters=_redlock_server_set.urls
    )
    module.BACKEND = broker.url
    return module


def app_env(broker_url: str, backend_url: str, masters: list[str], queue: str = "lockapp") -> dict[str, str]:
    return {
        "LOCKAPP_BROKER": broker_url,
        "LOCKAPP_BACKEND": backend_url,
        "LOCKAPP_MASTERS": ",".join(masters),
        "LOCKAPP_QUEUE": queue,
    }


def start_worker(
    env: dict[str, str], *, pool: str, concurrency: int, queue: str, app: str = "lockapp"
) -> CeleryWorker:
    """A real worker of ``app`` (a module of this folder) consuming ``queue``."""
    return CeleryWorker(
        app,
        pool=pool,
        concurrency=concurrency,
        queues=[queue],
        env=env,
        pythonpath=[str(HERE), str(ROOT)],
    ).start()


POOLS = {"prefork": (2, 2), "threads": (1, 4)}  # pool -> (workers, concurrency each)


@pytest.fixture(scope="session")
def worker_pools(
    lockapp: Any, broker: RedisServer, _redlock_server_set: ServerSet
) -> Iterator[dict[str, tuple[str, list[CeleryWorker]]]]:
    """pool name -> (its queue, its running workers); started once per session."""
    started: dict[str, tuple[str, list[CeleryWorker]]] = {}
    try:
        for pool, (count, concurrency) in POOLS.items():
            queue = f"q-{pool}-{RUN}"
            env = app_env(broker.url, broker.url, _redlock_server_set.urls, queue)
            workers = [
                start_worker(env, pool=pool, concurrency=concurrency, queue=queue) for _ in range(count)
            ]
            started[pool] = (queue, workers)
        yield started
    finally:
        # Tests are over: a task some test left running is not waited for past a short grace.
        stop_all([w for _, workers in started.values() for w in workers], timeout=5.0)


@pytest.fixture(params=sorted(POOLS))
def pool(
    request: pytest.FixtureRequest,
    worker_pools: dict[str, tuple[str, list[CeleryWorker]]],
    redlock_masters: ServerSet,
) -> tuple[str, str, list[CeleryWorker]]:
    """(pool name, queue, workers), with the masters reset for the test."""
    queue, workers = worker_pools[request.param]
    for worker in workers:
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return request.param, queue, workers


@pytest.fixture
def tag() -> str:
    """A name unique to this test, for keys and record lists: stale messages cannot interfere."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def finishing_waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every wait a publish in this process began before its answer (a finished run's release
    on its way, up to ``FINISHING_WAIT``; a marker whose publish has not returned), as
    ``key (seconds)``, recorded as each begins, whatever its length: what a publish decided,
    whatever a loaded host does to how long it took. A duplicate answered at once has none."""
    from celery_redlock.celery import enqueue

    waited: list[str] = []
    wait_out = enqueue._wait_out

    def recorded(
        task: Any,
        redlock: Any,
        name: str,
        value: str,
        ttl: float,
        existing: Any,
        seconds: float,
        settled: Any,
    ) -> Any:
        waited.append(f"{name} ({seconds:g} s)")
        return wait_out(task, redlock, name, value, ttl, existing, seconds, settled)

    monkeypatch.setattr(enqueue, "_wait_out", recorded)
    return waited


def records(lockapp: Any, name: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in lockapp.store().lrange(name, 0, -1)]


def listed(broker: RedisServer, name: str) -> list[dict[str, Any]]:
    """The JSON records a test app pushed to the list ``name`` on the broker's server."""
    client = redis.Redis.from_url(broker.url, socket_timeout=5)
    try:
        return [json.loads(raw) for raw in client.lrange(name, 0, -1)]
    finally:
        client.close()


def celery_cli(app: str, env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``celery -A <app> redlock <args>`` run from this folder, as an operator runs it."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "redlock", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE,
        timeout=timeout,
    )


def holds(intervals: list[dict[str, Any]]) -> list[Hold]:
    """Recorded intervals as windows for the overlap check; each carries its record back."""
    return [Hold(i["key"], i["start"], i["end"], owner=i["task_id"], info=i) for i in intervals]


def contend_while_running(
    result: Any, urls: list[str], key: str, every: float = 0.1
) -> tuple[int, float | None]:
    """Try to take ``key`` every ``every`` seconds until ``result`` is ready: how many attempts
    were refused, and when (monotonic) a contender got in, or None.

    A run's lock is released before its result can be seen, so a contender may get in after the
    body ended and before ``result.ready()``; the caller compares the time it got in with the
    body's recorded end (see :func:`ended_at`): only one that got in before it took a held lock.
    """
    import time

    from celery_redlock import Redlock

    attempts = 0
    with Redlock(urls) as contender:
        while not result.ready():
            lock = contender.lock(key, ttl=5)
            if lock.acquire(blocking=False):
                got_in = time.clock_gettime(time.CLOCK_MONOTONIC)
                lock.release()
                return attempts, got_in
            attempts += 1
            time.sleep(every)
    return attempts, None


def ended_at(lockapp: Any, tag: str) -> float:
    """When the body recording to ``tag`` ended (the ``end`` of its record that has one), on the
    same monotonic clock as this process (the workers run on this machine)."""
    return float(next(r["end"] for r in records(lockapp, tag) if "end" in r))


def woken_by_release(lockapp: Any, tag: str, intervals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The wait-mode runs of ``intervals`` (lock ``res:<tag>``) that fell back to a lock retry for
    any reason but unavailability (``[]`` when each was woken by a release). A run whose first
    round got no quorum for want of replies (late ones, on a loaded host) is retried whatever
    its mode, never made to wait (docs/celery.md), and that retry is not a failed wake. At least
    half the runs must have waited, so that the wake was exercised at all."""
    fell_back = {r["task_id"] for r in intervals if r["attempt"]}
    assert len(fell_back) <= len(intervals) // 2, f"{len(fell_back)} of {len(intervals)} runs were retried"
    decisions = [r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]
    unavailable = {r["task_id"] for r in decisions if r["policy"] == "retry" and not r["contended"]}
    return [r for r in intervals if r["task_id"] in fell_back - unavailable]
