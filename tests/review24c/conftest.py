"""Real servers and real workers for the issue 24 (c) review: a broker (result backend and
records on other databases), three lock masters, and workers started on demand, each on a queue
of its own, stopped by pid at the end of the session."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

from ..appservers import app_env, app_servers, configured

ROOT = Path(__file__).resolve().parents[2]
Servers = tuple[RedisServer, ServerSet]


@pytest.fixture(scope="session")
def r24_servers() -> Iterator[Servers]:
    with app_servers() as servers:
        yield servers


@pytest.fixture(scope="session")
def r24(r24_servers: Servers) -> Iterator[Any]:
    """The test process's side of the app (a publisher), configured like the workers."""
    from . import app

    with configured(app.app, app_env("R24", *r24_servers), "R24"):
        yield app


Workers = Callable[..., tuple[str, CeleryWorker]]


@pytest.fixture(scope="session")
def r24_workers(r24: Any, r24_servers: Servers) -> Iterator[Workers]:
    """``start(pool, concurrency, **env)``: (queue, worker) of a running worker of that kind,
    started on first use and shared afterwards."""
    run = uuid.uuid4().hex[:8]
    started: dict[tuple[Any, ...], tuple[str, CeleryWorker]] = {}

    def start(pool: str, concurrency: int | None = 2, **extra: str) -> tuple[str, CeleryWorker]:
        key = (pool, concurrency, *sorted(extra.items()))
        if key not in started:
            queue = f"r24-{pool}-{concurrency}-{len(started)}-{run}"
            worker = CeleryWorker(
                "tests.review24c.app",
                pool=pool,
                concurrency=concurrency,
                queues=[queue],
                env={**app_env("R24", *r24_servers), **extra},
                pythonpath=[str(ROOT)],
                cwd=str(ROOT),
            )
            started[key] = (queue, worker)
            worker.start()
        return started[key]

    try:
        yield start
    finally:
        for _, worker in started.values():
            worker.cleanup()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]


def wait_for(predicate: Callable[[], Any], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
