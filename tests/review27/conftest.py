"""Real servers for the issue 27 review: a broker (also the result backend and the run records)
and three lock masters; everything stopped by pid at the end."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import RedisServer, ServerSet

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class World:
    broker: RedisServer
    masters: ServerSet

    @property
    def env(self) -> dict[str, str]:
        return {"R27_BROKER": self.broker.url, "R27_MASTERS": ",".join(self.masters.urls)}


@pytest.fixture(scope="session")
def world() -> Iterator[World]:
    with RedisServer() as broker, ServerSet(3) as masters:
        yield World(broker, masters)


@pytest.fixture(scope="session")
def r27(world: World) -> Iterator[Any]:
    """The test process's side of the app (a publisher), configured like the worker."""
    from . import app

    os.environ.update(world.env)
    app.app.conf.update(
        broker_url=world.broker.url, result_backend=world.broker.url, redlock_masters=world.masters.urls
    )
    app.app.finalize(auto=True)
    try:
        yield app
    finally:
        close_app_redlock(app.app)


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]
