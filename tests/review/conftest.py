"""Real servers and real workers for the adversarial review: a broker (also the result backend
and the records store, on other databases), three lock masters, and workers started on demand
per pool, each consuming a queue of its own, shared for the session (``tests/appservers.py``
says why not per package)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

from ..appservers import app_env, app_servers, configured

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def review_servers() -> Iterator[tuple[RedisServer, ServerSet]]:
    with app_servers() as servers:
        yield servers


def review_env(broker: RedisServer, masters: ServerSet) -> dict[str, str]:
    return app_env("REVIEW", broker, masters)


@pytest.fixture(scope="session")
def review_app(review_servers: tuple[RedisServer, ServerSet]) -> Iterator[Any]:
    """The test process's side of ``reviewapp``, configured like the workers."""
    from . import reviewapp

    with configured(reviewapp.app, review_env(*review_servers), "REVIEW"):
        yield reviewapp


Workers = Callable[..., str]


@pytest.fixture(scope="session")
def review_workers(review_app: Any, review_servers: tuple[RedisServer, ServerSet]) -> Iterator[Workers]:
    """``start(pool, concurrency)``: the queue of a running worker of that pool (started on first
    use, shared afterwards, stopped by pid at the end of the package)."""
    env = review_env(*review_servers)
    run = uuid.uuid4().hex[:8]
    started: dict[tuple[str, int | None, str], tuple[str, CeleryWorker]] = {}

    def start(pool: str, concurrency: int | None = 2, flavour: str = "") -> str:
        key = (pool, concurrency, flavour)
        if key not in started:
            queue = f"review-{pool}-{concurrency}-{flavour}-{run}"
            worker = CeleryWorker(
                "tests.review.reviewapp",
                pool=pool,
                concurrency=concurrency,
                queues=[queue],
                env=env,
                pythonpath=[str(ROOT)],
                cwd=str(ROOT),
            )
            started[key] = (queue, worker)
            worker.start()
        queue, worker = started[key]
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
        return queue

    try:
        yield start
    finally:
        for _, worker in started.values():
            worker.cleanup()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]
