"""Real servers for review47: three lock masters on loopback, a broker, and real threads and
prefork workers (started only by the tests that ask for them). Everything is stopped by pid at
the end, through the testing helpers' context managers."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock import Redlock
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def masters47() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def rl47(masters47: ServerSet) -> Iterator[Redlock]:
    for server in masters47:
        server.flushall()
    with Redlock(masters47.urls) as redlock:
        yield redlock


@pytest.fixture
def other47(masters47: ServerSet) -> Iterator[Redlock]:
    """Another client of the same masters."""
    with Redlock(masters47.urls) as redlock:
        yield redlock


@pytest.fixture
def beat47() -> Iterator[Heartbeat]:
    beat = Heartbeat(name="review47-heartbeat")
    yield beat
    beat.stop()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]


class World:
    def __init__(self, broker: RedisServer, masters: ServerSet) -> None:
        self.broker, self.masters = broker, masters
        self.env = {"R47_BROKER": broker.url, "R47_MASTERS": ",".join(masters.urls)}


@pytest.fixture(scope="session")
def world47(masters47: ServerSet) -> Iterator[World]:
    with RedisServer() as broker:
        yield World(broker, masters47)


@pytest.fixture(scope="session")
def r47(world47: World) -> Iterator[Any]:
    os.environ.update(world47.env)
    from . import app

    app.app.conf.update(
        broker_url=world47.broker.url,
        result_backend=world47.broker.url,
        redlock_masters=world47.masters.urls,
    )
    try:
        yield app
    finally:
        close_app_redlock(app.app)


def _worker(world: World, pool: str, concurrency: int) -> Iterator[tuple[CeleryWorker, str]]:
    queue = f"r47-{pool}-{uuid.uuid4().hex[:8]}"
    with CeleryWorker(
        "tests.review47.app",
        pool=pool,
        concurrency=concurrency,
        queues=[queue],
        env=world.env,
        pythonpath=[str(ROOT)],
    ) as worker:
        yield worker, queue


@pytest.fixture(scope="module", params=["threads", "prefork"])
def worker47(request: Any, r47: Any, world47: World) -> Iterator[tuple[CeleryWorker, str]]:
    yield from _worker(world47, request.param, 2)
