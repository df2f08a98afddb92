"""Real servers for the issue 24 (d) review: a broker, a result backend on a server of its own
(so that a test can stop it alone), three lock masters; and one real worker, on a queue of its
own that no test publishes to: it is there to receive revokes (and store REVOKED, as Celery's
worker does for a message it has not started). Everything stopped by pid at the end."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

ROOT = Path(__file__).resolve().parents[2]


class World:
    def __init__(self, broker: RedisServer, backend: RedisServer, masters: ServerSet) -> None:
        self.broker, self.backend, self.masters = broker, backend, masters
        self.env = {
            "R24D_BROKER": broker.url,
            "R24D_BACKEND": backend.url,
            "R24D_MASTERS": ",".join(masters.urls),
        }


@pytest.fixture(scope="session")
def world() -> Iterator[World]:
    with RedisServer() as broker, RedisServer() as backend, ServerSet(3) as masters:
        yield World(broker, backend, masters)


@pytest.fixture(scope="session")
def r24d(world: World) -> Iterator[Any]:
    """The test process's side of the app (a publisher), configured like the worker."""
    from . import app

    os.environ.update(world.env)
    app.app.conf.update(
        broker_url=world.broker.url,
        result_backend=world.backend.url,
        redlock_masters=world.masters.urls,
    )
    app.app.finalize(auto=True)
    try:
        yield app
    finally:
        close_app_redlock(app.app)


@pytest.fixture(scope="session")
def revoker(r24d: Any, world: World) -> Iterator[CeleryWorker]:
    """A real worker that consumes a queue of its own (nothing is published to it)."""
    worker = CeleryWorker(
        "tests.review24d.app",
        pool="threads",
        concurrency=1,
        queues=[f"r24d-idle-{uuid.uuid4().hex[:8]}"],
        env=world.env,
        pythonpath=[str(ROOT)],
    )
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]
