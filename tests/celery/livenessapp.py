"""The Celery app of tests/celery/test_celery_release_liveness.py: ``celery -A livenessapp
worker`` and ``celery -A livenessapp redlock release``, configured from the environment:
``LIVENESSAPP_BROKER`` (broker, result backend and the runs' records), ``LIVENESSAPP_MASTERS``,
``LIVENESSAPP_QUEUE``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redlock import RedlockTask

BROKER = os.environ.get("LIVENESSAPP_BROKER", "redis://127.0.0.1:1/0")

app = Celery("livenessapp", broker=BROKER, backend=BROKER)
app.conf.update(
    redlock_masters=os.environ.get("LIVENESSAPP_MASTERS") or None,
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.2,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("LIVENESSAPP_QUEUE", "livenessapp"),
)


def record(name: str, **fields: Any) -> None:
    client = redis.Redis.from_url(BROKER, socket_timeout=5)
    try:
        client.rpush(name, json.dumps({"pid": os.getpid(), **fields}))
    finally:
        client.close()


def _run(task: Any, key: str, seconds: float, record_to: str) -> str:
    """Record the start (monotonic, shared by every process of this host), hold the lock for
    ``seconds`` checking every 0.1 s that it is still owned, record the end and whether the
    lock was lost meanwhile."""
    start = time.monotonic()
    record(record_to, event="start", at=start, key=key, task_id=task.request.id)
    lost = None
    while time.monotonic() - start < seconds:
        time.sleep(min(0.1, max(0.0, seconds - (time.monotonic() - start))))
        if not task.redlock.owned():
            lost = task.redlock.lost_reason or "not owned"
            break
    record(record_to, event="end", at=time.monotonic(), key=key, task_id=task.request.id, lost=lost)
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="live:<key>",
    lock_ttl=3.0,
    lock_heartbeat_interval=2.0,
    name="livenessapp.slow",
)
def slow(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Extended every 2 s on a 3 s TTL (a valid interval, above the old ttl / 2 guess)."""
    return _run(self, key, seconds, record_to)


@app.task(bind=True, base=RedlockTask, lock_key="live:<key>", lock_ttl=3.0, name="livenessapp.default")
def default(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Extended at the heartbeat's default interval."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="live:<key>",
    lock_ttl=20.0,
    lock_heartbeat=False,
    name="livenessapp.nobeat",
)
def nobeat(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Never extended: its lock lasts its 20 s TTL."""
    return _run(self, key, seconds, record_to)
