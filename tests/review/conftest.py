"""Real servers and real workers for the adversarial review: a broker (also the result backend
and the records store, on other databases), three lock masters, and workers started on demand
per pool, each consuming a queue of its own, shared by the tests of the package."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

ROOT = Path(__file__).resolve().parents[2]
MASTERS = 3


@pytest.fixture(scope="package")
def review_servers() -> Iterator[tuple[RedisServer, ServerSet]]:
    with RedisServer() as broker, ServerSet(MASTERS) as masters:
        yield broker, masters


def review_env(broker: RedisServer, masters: ServerSet) -> dict[str, str]:
    base = broker.url.rsplit("/", 1)[0]
    return {
        "REVIEW_BROKER": f"{base}/0",
        "REVIEW_BACKEND": f"{base}/1",
        "REVIEW_RECORDS": f"{base}/2",
        "REVIEW_MASTERS": ",".join(masters.urls),
    }


@pytest.fixture(scope="package")
def review_app(review_servers: tuple[RedisServer, ServerSet]) -> Iterator[Any]:
    """The test process's side of ``reviewapp``, configured like the workers."""
    env = review_env(*review_servers)
    os.environ.update(env)
    from . import reviewapp

    reviewapp.app.conf.update(
        broker_url=env["REVIEW_BROKER"],
        result_backend=env["REVIEW_BACKEND"],
        redlock_masters=env["REVIEW_MASTERS"],
    )
    yield reviewapp
    close_app_redlock(reviewapp.app)


Workers = Callable[..., str]


@pytest.fixture(scope="package")
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
