"""The Celery app of the operators' tests (tests/celery/test_celery_ops.py): ``celery -A opsapp
worker`` and ``celery -A opsapp redlock ...``, configured from the environment like lockapp:
``OPSAPP_BROKER`` (broker, result backend and records store), ``OPSAPP_MASTERS`` (lock masters),
``OPSAPP_QUEUE``, and ``OPSAPP_METRICS`` (``redlock_metrics``: ``host:port`` to serve them)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redlock import RedlockTask

BROKER = os.environ.get("OPSAPP_BROKER", "redis://127.0.0.1:1/0")

app = Celery("opsapp", broker=BROKER, backend=BROKER)
app.conf.update(
    redlock_masters=os.environ.get("OPSAPP_MASTERS") or None,
    redlock_ttl=30.0,
    redlock_metrics=os.environ.get("OPSAPP_METRICS") or False,
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.2,
    worker_prefetch_multiplier=1,
    # A message is acknowledged when its run ends: a worker whose children are all busy then
    # reserves no more (acknowledged at the start, a running message leaves room to reserve one
    # more per child, and four long runs could land three on one worker of two children).
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("OPSAPP_QUEUE", "opsapp"),
)


def record(name: str, **fields: Any) -> None:
    client = redis.Redis.from_url(BROKER, socket_timeout=5)
    try:
        client.rpush(name, json.dumps({"pid": os.getpid(), **fields}))
    finally:
        client.close()


@app.task(bind=True, base=RedlockTask, lock_key="ops:<key>", lock_ttl=60.0, name="opsapp.hold")
def hold(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Hold ``key`` for ``seconds`` (its lock's TTL 60 s, extended every 20 s), or until the
    test sets ``<record_to>:stop``: a test that looks at held locks ends the holds when it is
    done looking, however slow a loaded machine made the looking."""
    record(record_to, event="start", key=key, task_id=self.request.id)
    client = redis.Redis.from_url(BROKER, socket_timeout=5)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not client.exists(f"{record_to}:stop"):
            time.sleep(0.05)
    finally:
        client.close()
    record(record_to, event="end", key=key, task_id=self.request.id)
    return key


@app.task(bind=True, base=RedlockTask, lock_key="ops:<key>", lock_ttl=1.5, name="opsapp.busy")
def busy(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Hold ``key`` for ``seconds`` with a short TTL: extended every 0.5 s while it runs; or, as
    ``hold``, until the test sets ``<record_to>:stop``."""
    record(record_to, event="start", key=key, task_id=self.request.id)
    client = redis.Redis.from_url(BROKER, socket_timeout=5)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not client.exists(f"{record_to}:stop"):
            time.sleep(0.05)
    finally:
        client.close()
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="ops:<key>",
    lock_contended="skip",
    name="opsapp.once",
)
def once(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Run unless ``key`` is held (a duplicate is skipped)."""
    record(record_to, event="ran", key=key, task_id=self.request.id)
    time.sleep(seconds)
    return key
