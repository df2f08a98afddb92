"""Real servers for the review of the heartbeat's remembered intervals, its mutex and its
thread's stop, and of after_return's release: three lock masters on loopback for the
heartbeat tests; a broker and one real threads worker for the after_return tests (started only
by the tests that ask for it). Everything is stopped at the end."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock import Lock, Redlock
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def masters46() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def rl46(masters46: ServerSet) -> Iterator[Redlock]:
    for server in masters46:
        server.flushall()
    with Redlock(masters46.urls) as redlock:
        yield redlock


@pytest.fixture
def beat46() -> Iterator[Heartbeat]:
    beat = Heartbeat(name="review46-heartbeat")
    yield beat
    beat.stop()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]


class World:
    def __init__(self, broker: RedisServer, masters: ServerSet) -> None:
        self.broker, self.masters = broker, masters
        self.env = {"R46_BROKER": broker.url, "R46_MASTERS": ",".join(masters.urls)}


@pytest.fixture(scope="session")
def world46(masters46: ServerSet) -> Iterator[World]:
    with RedisServer() as broker:
        yield World(broker, masters46)


@pytest.fixture
def contender(world46: World) -> Iterator[Redlock]:
    """Another Redlock client of the same masters."""
    with Redlock(world46.masters.urls) as redlock:
        yield redlock


@pytest.fixture(scope="session")
def r46(world46: World) -> Iterator[Any]:
    """The test process's side of the app (a publisher), configured like the worker."""
    os.environ.update(world46.env)
    from . import app

    app.app.conf.update(
        broker_url=world46.broker.url,
        result_backend=world46.broker.url,
        redlock_masters=world46.masters.urls,
    )
    try:
        yield app
    finally:
        close_app_redlock(app.app)


def _worker(world: World, pool: str, concurrency: int) -> Iterator[tuple[CeleryWorker, str]]:
    """A real worker of ``pool`` on a queue of its own, stopped when the session ends."""
    queue = f"r46-{pool}-{uuid.uuid4().hex[:8]}"
    with CeleryWorker(
        "tests.review46.app",
        pool=pool,
        concurrency=concurrency,
        queues=[queue],
        env=world.env,
        pythonpath=[str(ROOT)],
    ) as worker:
        yield worker, queue


@pytest.fixture(scope="session")
def threads46(r46: Any, world46: World) -> Iterator[tuple[CeleryWorker, str]]:
    """A real threads worker (concurrency 4) and the queue it consumes."""
    yield from _worker(world46, "threads", 4)


@pytest.fixture(scope="session")
def prefork46(r46: Any, world46: World) -> Iterator[tuple[CeleryWorker, str]]:
    """A real prefork worker (concurrency 2) and the queue it consumes."""
    yield from _worker(world46, "prefork", 2)


def outlives(*locks: Lock, seconds: float, what: str = "") -> None:
    """Every lock of ``locks`` stays owned (kept alive by its heartbeat) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for lock in locks:
            assert lock.owned(), f"{lock!r} was not kept alive{f': {what}' if what else ''}"
        time.sleep(0.05)
