"""The Celery app of the adversarial review of ``lock_enqueue`` (``celery -A enqueuereviewapp worker``).

Configured from the same environment as ``lockapp`` / ``enqueueapp`` (``LOCKAPP_BROKER``,
``LOCKAPP_BACKEND``, ``LOCKAPP_MASTERS``, ``LOCKAPP_QUEUE``). Each task records its runs on a
Redis list (JSON, ``CLOCK_MONOTONIC`` times, comparable across processes on Linux).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redlock import RedlockTask

BROKER = os.environ.get("LOCKAPP_BROKER", "redis://127.0.0.1:1/0")
BACKEND = os.environ.get("LOCKAPP_BACKEND", "redis://127.0.0.1:1/0")

app = Celery("enqueuereviewapp", broker=BROKER, backend=BACKEND)
app.conf.update(
    redlock_masters=os.environ.get("LOCKAPP_MASTERS") or None,
    redlock_ttl=5.0,
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.3,
    redlock_enqueue_ttl=30.0,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("LOCKAPP_QUEUE", "enqueuereviewapp"),
)

_store: redis.Redis | None = None
_store_pid = 0


def store() -> redis.Redis:
    global _store, _store_pid
    if _store is None or _store_pid != os.getpid():
        _store = redis.Redis.from_url(BACKEND, socket_timeout=5)
        _store_pid = os.getpid()
    return _store


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def record(name: str, **fields: Any) -> None:
    fields.setdefault("at", now())
    fields.setdefault("pid", os.getpid())
    store().rpush(name, json.dumps(fields))


def _run(task: Any, key: str, seconds: float, record_to: str) -> str:
    start = now()
    record(record_to, event="start", key=key, task_id=task.request.id, start=start)
    time.sleep(seconds)
    record(record_to, event="interval", key=key, task_id=task.request.id, start=start, end=now())
    return key


@app.task(bind=True, base=RedlockTask, name="review.hold", lock_key="rv:<key>", lock_enqueue="raise")
def hold(self: Any, key: str, seconds: float, record_to: str) -> str:
    """Hold ``key`` for ``seconds``; a duplicate publish raises AlreadyQueued."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.long_ttl",
    lock_key="rv:<key>",
    lock_enqueue="raise",
    lock_ttl=20.0,
)
def long_ttl(self: Any, key: str, seconds: float, record_to: str) -> str:
    """A run lock of 20 s (and a marker of 30 s): a key freed sooner was freed by an exit path."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.rekey",
    lock_key="rv:<key>",
    lock_enqueue="raise",
)
def rekey(self: Any, key: str, record_to: str) -> str:
    """Retries itself once *with other arguments* (``self.retry(args=...)``, a documented Celery
    pattern: the next attempt works on the next page, the next shard, a fallback id). The retried
    message's key is ``<key>-next``, not ``<key>``."""
    record(record_to, event="run", key=key, task_id=self.request.id, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(args=(f"{key}-next", record_to), countdown=0.2)
    return key


class SlowRetryHook(RedlockTask):
    """A base whose ``on_retry`` does some work (an alert, a database write): it runs in the
    tracer after the retried message was published, and before ``after_return``."""

    abstract = True

    def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        time.sleep(1.0)


@app.task(
    bind=True,
    base=SlowRetryHook,
    name="review.retry_slow_hook",
    lock_key="rv:<key>",
    lock_enqueue="raise",
)
def retry_slow_hook(self: Any, key: str, seconds: float, record_to: str) -> None:
    """Works ``seconds``, then retries itself at once; every attempt does the same."""
    record(record_to, event="start", key=key, task_id=self.request.id, retries=self.request.retries)
    time.sleep(seconds)
    raise self.retry(countdown=0)


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.late",
    lock_key="rv:<key>",
    lock_enqueue="return_existing",
    lock_ttl=2.0,
    acks_late=True,
    reject_on_worker_lost=True,
    lock_retry_backoff=0.5,
    lock_retry_backoff_max=0.5,
)
def late(self: Any, key: str, record_to: str) -> str:
    """acks_late + reject_on_worker_lost: a pool child killed while running it gets it
    redelivered. The first run of a ``record_to`` sleeps 30 s (to be killed); later ones 0.1 s."""
    first = bool(store().set(f"{record_to}:first", "1", nx=True, ex=600))
    return _run(self, key, 30.0 if first else 0.1, record_to)


@app.task(bind=True, base=RedlockTask, name="review.member", lock_key="rv:<key>", lock_enqueue="raise")
def member(self: Any, value: int, key: str, record_to: str) -> int:
    """A chord header member of one key."""
    record(record_to, event="member", key=key, task_id=self.request.id, value=value)
    time.sleep(0.1)
    return value


@app.task(bind=True, base=RedlockTask, name="review.total", lock_key="rv:<key>", lock_enqueue="raise")
def total(self: Any, values: list[int], key: str, record_to: str) -> int:
    """A chord body (or a link callback) on the same key as its header."""
    record(record_to, event="total", key=key, task_id=self.request.id, values=values)
    return sum(values) if isinstance(values, list) else int(values)


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.expiring",
    lock_key="rv:<key>",
    lock_enqueue="return_existing",
    lock_release="on_expiry",
    lock_ttl=10.0,
)
def expiring(self: Any, key: str, seconds: float, record_to: str) -> str:
    """At most one run per key per 10 s: the lock is left to expire after a success."""
    return _run(self, key, seconds, record_to)
