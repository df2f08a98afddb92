"""Servers and workers of the golden outcome matrix, once per module: one Redis for broker, result
backend and records (records in db 1), three lock masters, and one real ``celery worker`` per
pool, each consuming a queue of its own, so a case picks its pool by the queue it sends to."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from celery_redlock import Redlock
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from celery_redlock.testing.pytest_plugin import stop_on_sigterm

ROOT = Path(__file__).resolve().parents[2]
APP_MODULE = "tests.golden_celery.pathsapp"
RUN = uuid.uuid4().hex[:8]

# pool -> worker concurrency (solo runs one task at a time whatever it is given)
WORKER_POOLS = {"solo": 1, "prefork": 2, "threads": 2}


@pytest.fixture(scope="module")
def golden_broker() -> Iterator[RedisServer]:
    stop_on_sigterm()
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def golden_masters() -> Iterator[ServerSet]:
    stop_on_sigterm()
    with ServerSet(3) as servers:
        yield servers


def records_url(broker: RedisServer) -> str:
    return f"redis://{broker.host}:{broker.port}/1"


@pytest.fixture(scope="module")
def golden_app(golden_broker: RedisServer, golden_masters: ServerSet) -> Iterator[ModuleType]:
    """The test process's side of ``pathsapp``, configured like the workers (eager runs, results,
    records)."""
    from tests.golden_celery import pathsapp

    pathsapp.configure(golden_broker.url, records_url(golden_broker), golden_masters.urls)
    yield pathsapp
    close_app_redlock(pathsapp.app)


@pytest.fixture(scope="module")
def golden_contender(golden_masters: ServerSet) -> Iterator[Redlock]:
    """The test process's own client of the masters, whose locks are the contenders."""
    with Redlock(golden_masters.urls, request_timeout=0.5) as redlock:  # as the app's (pathsapp)
        yield redlock


@pytest.fixture(scope="module")
def golden_workers(
    golden_app: ModuleType, golden_broker: RedisServer, golden_masters: ServerSet
) -> Iterator[dict[str, str]]:
    """pool -> the queue its worker consumes; the workers start together and stop by pid."""
    env = {
        "GOLDEN_BROKER": golden_broker.url,
        "GOLDEN_RECORDS": records_url(golden_broker),
        "GOLDEN_MASTERS": ",".join(golden_masters.urls),
    }
    workers: dict[str, CeleryWorker] = {}
    queues = {pool: f"golden-{pool}-{RUN}" for pool in WORKER_POOLS}
    try:
        for pool, concurrency in WORKER_POOLS.items():
            worker = CeleryWorker(
                APP_MODULE,
                pool=pool,
                concurrency=concurrency,
                queues=[queues[pool]],
                env=env,
                pythonpath=[str(ROOT)],
                name=f"golden-{pool}",
            )
            workers[pool] = worker
            worker.start(wait=False)
        for worker in workers.values():
            worker.wait_ready()
        yield queues
        for pool, worker in workers.items():
            assert worker.running, f"the {pool} worker died; log tail:\n{worker.log_tail()}"
    finally:
        for worker in workers.values():
            worker.cleanup()
