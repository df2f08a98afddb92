"""Real servers and real workers for the progress tests, started once per session and shared
by every test and every hypothesis example in it (each uses keys of its own, so nothing stale
can interfere): a broker (also the result backend and the history store, on other databases),
three lock masters, and one worker per pool, each consuming a queue of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

from ..appservers import app_env, app_servers, configured

ROOT = Path(__file__).resolve().parents[2]
# pool -> (workers, concurrency each); two solo workers, so that a solo pool can contend at all.
POOLS: dict[str, tuple[int, int | None]] = {"prefork": (1, 2), "threads": (1, 4), "solo": (2, None)}

Pool = tuple[str, str]  # (pool name, its queue)


@pytest.fixture(scope="session")
def progress_servers() -> Iterator[tuple[RedisServer, ServerSet]]:
    with app_servers() as servers:
        yield servers


def _env(broker: RedisServer, masters: ServerSet) -> dict[str, str]:
    return app_env("PROGRESS", broker, masters)


@pytest.fixture(scope="session")
def progress_app(progress_servers: tuple[RedisServer, ServerSet]) -> Iterator[Any]:
    """The test process's side of ``progressapp``, configured like the workers."""
    from . import progressapp

    with configured(progressapp.app, _env(*progress_servers), "PROGRESS"):
        yield progressapp.app


@pytest.fixture(scope="session")
def progress_workers(
    progress_app: Any, progress_servers: tuple[RedisServer, ServerSet]
) -> Iterator[dict[str, tuple[str, list[CeleryWorker]]]]:
    """pool name -> (its queue, its workers); all started at once, each waited for by its log."""
    env = _env(*progress_servers)
    run = uuid.uuid4().hex[:8]
    started: dict[str, tuple[str, list[CeleryWorker]]] = {}
    try:
        for pool, (count, concurrency) in POOLS.items():
            queue = f"progress-{pool}-{run}"
            workers = [
                CeleryWorker(
                    "tests.progress.progressapp",
                    pool=pool,
                    concurrency=concurrency,
                    queues=[queue],
                    env=env,
                    pythonpath=[str(ROOT)],
                    cwd=str(ROOT),
                ).start(wait=False)
                for _ in range(count)
            ]
            started[pool] = (queue, workers)  # type: ignore[assignment]
        for _, workers in started.values():
            for worker in workers:
                worker.wait_ready()
        yield started
    finally:
        for _, workers in started.values():
            for worker in workers:
                worker.cleanup()


def live_queue(workers: dict[str, tuple[str, list[CeleryWorker]]], pool: str) -> str:
    """The queue of ``pool``'s workers, once they are known to be running."""
    queue, running = workers[pool]
    for worker in running:
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return queue
