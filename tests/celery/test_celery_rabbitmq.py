"""The core duplicate test with RabbitMQ as the broker (required in CI, skipped elsewhere)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from conftest import HERE, ROOT, app_env, holds, records

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet, find_overlaps

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _rabbitmq_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.rabbitmq
@pytest.mark.timeout(120)
def test_duplicates_never_overlap_over_rabbitmq(
    lockapp: Any, broker: RedisServer, redlock_masters: ServerSet, tag: str
) -> None:
    if not _rabbitmq_reachable():
        if os.environ.get("CELERY_REDLOCK_REQUIRE_RABBITMQ") == "1":
            pytest.fail(
                "RabbitMQ is required (CELERY_REDLOCK_REQUIRE_RABBITMQ=1) but nothing "
                "answers on 127.0.0.1:5672"
            )
        pytest.skip(
            "RabbitMQ not reachable on 127.0.0.1:5672 "
            "(set CELERY_REDLOCK_REQUIRE_RABBITMQ=1 to make this a failure)"
        )
    queue = f"q-amqp-{tag}"  # unique per run: stale messages from earlier runs cannot interfere
    env = app_env(AMQP_URL, broker.url, redlock_masters.urls, queue)
    workers = [
        CeleryWorker(
            "lockapp",
            pool="prefork",
            concurrency=2,
            queues=[queue],
            env=env,
            pythonpath=[str(HERE), str(ROOT)],
        )
        for _ in range(2)
    ]
    sender = lockapp.app.__class__("amqp-sender", broker=AMQP_URL, backend=broker.url, set_as_current=False)
    try:
        for worker in workers:
            worker.start()
        dup = f"{tag}-dup"
        results = [sender.send_task("lockapp.hold", (dup, 0.2, tag), queue=queue) for _ in range(6)]
        results += [sender.send_task("lockapp.hold", (f"{tag}-{i}", 0.2, tag), queue=queue) for i in range(2)]
        for result in results:
            result.get(timeout=60)
    finally:
        for worker in workers:
            worker.stop()
        with sender.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        sender.close()
    intervals = [r for r in records(lockapp, tag) if r["event"] == "interval"]
    assert sorted(r["key"] for r in intervals) == sorted([dup] * 6 + [f"{tag}-0", f"{tag}-1"])
    assert find_overlaps(holds(intervals)) == []
