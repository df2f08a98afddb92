"""The lock-retry tests' app (``retryapp``) on the Celery tests' broker, and its real workers."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import conftest
import pytest

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet


@pytest.fixture(scope="module")
def retry_app(broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[tuple[Any, dict[str, str]]]:
    """``retryapp``, pointed at the session's broker and masters, and the environment its
    workers start with (each test's keys and queues are its own)."""
    env = {"RETRY_BROKER": broker.url, "RETRY_MASTERS": ",".join(_redlock_server_set.urls)}
    os.environ.update(env)
    import retryapp

    retryapp.BROKER = broker.url
    retryapp.app.conf.update(
        broker_url=broker.url,
        result_backend=f"retryapp.SlowRetryStore+{broker.url}",
        redlock_masters=_redlock_server_set.urls,
    )
    yield retryapp, env


def start_worker(env: dict[str, str], pool: str, concurrency: int, **extra: str) -> tuple[CeleryWorker, str]:
    """A real worker of ``retryapp`` on a queue of its own, ``extra`` added to its environment."""
    queue = f"retry-{uuid.uuid4().hex[:8]}"
    worker = conftest.start_worker(
        {**env, **extra}, pool=pool, concurrency=concurrency, queue=queue, app="retryapp"
    )
    return worker, queue
