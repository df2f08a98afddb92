"""The Celery app of the enqueue tests' real workers (``celery -A enqueueapp worker``).

Configured from the same environment as ``lockapp`` (``LOCKAPP_BROKER``, ``LOCKAPP_BACKEND``,
``LOCKAPP_MASTERS``, ``LOCKAPP_QUEUE``). Every task records its run on a Redis list (JSON, with
``CLOCK_MONOTONIC`` times, comparable across processes on Linux).
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

app = Celery("enqueueapp", broker=BROKER, backend=BACKEND)
app.conf.update(
    redlock_masters=os.environ.get("LOCKAPP_MASTERS") or None,
    redlock_ttl=5.0,
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.3,
    redlock_enqueue_ttl=30.0,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("LOCKAPP_QUEUE", "enqueueapp"),
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
    record(
        record_to,
        event="interval",
        key=key,
        task_id=task.request.id,
        start=start,
        end=now(),
        owned=task.redlock.owned(),
        retries=task.request.retries,
    )
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.hold",
    lock_key="enq:<key>",
    lock_ttl=2.0,
    lock_enqueue="return_existing",
)
def hold(self: Any, key: str, seconds: float, record_to: str) -> str:
    """Hold ``key`` for ``seconds`` (deduplicated at publish: the existing result is returned)."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True, base=RedlockTask, name="enqueueapp.hold_raise", lock_key="enq:<key>", lock_enqueue="raise"
)
def hold_raise(self: Any, key: str, seconds: float, record_to: str) -> str:
    """As ``hold``, but a duplicate publish raises AlreadyQueued."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.limited",
    lock_key="enq:<key>",
    lock_ttl=20.0,
    lock_enqueue="raise",
    time_limit=1.0,
)
def limited(self: Any, key: str, seconds: float, record_to: str) -> str:
    """Killed by its hard time limit when ``seconds`` > 1 (a TTL far longer than the limit)."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.retry_once",
    lock_key="enq:<key>",
    lock_enqueue="raise",
    default_retry_delay=0.3,
)
def retry_once(self: Any, key: str, record_to: str) -> int:
    """Runs twice: the first run retries itself (countdown 0.3 s), the second returns."""
    record(record_to, event="run", key=key, task_id=self.request.id, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry()
    return int(self.request.retries)


@app.task(bind=True, base=RedlockTask, name="enqueueapp.step", lock_key="enq:<key>", lock_enqueue="raise")
def step(self: Any, value: int, key: str, record_to: str) -> int:
    """A chain or group member: value + 1."""
    record(record_to, event="step", key=key, task_id=self.request.id, value=value)
    time.sleep(0.1)
    return value + 1


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.short_marker",
    lock_key="enq:<key>",
    lock_enqueue="raise",
    lock_enqueue_ttl=1.0,
)
def short_marker(self: Any, key: str, seconds: float, record_to: str) -> str:
    """A marker of 1 s: a countdown or ETA longer than that must still keep the key."""
    return _run(self, key, seconds, record_to)


# -- tests/celery/test_celery_enqueue_progress.py ---------------------------------------------


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.other",
    lock_key="enq:<key>",
    lock_ttl=2.0,
    lock_enqueue="return_existing",
)
def other(self: Any, key: str, seconds: float, record_to: str) -> str:
    """Another task on ``hold``'s lock key: shares its lock (never runs beside it), not its
    deduplication (a queued ``hold`` is no answer to a publish of ``other``)."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.skipper",
    lock_key="enq:<key>",
    lock_enqueue="raise",
    lock_contended="skip",
)
def skipper(self: Any, key: str, seconds: float, record_to: str) -> str:
    """Another task on ``hold``'s lock key, skipped when it finds the key held at run time."""
    return _run(self, key, seconds, record_to)


@app.task(
    bind=True,
    base=RedlockTask,
    name="enqueueapp.queued_retry",
    lock_key="enq:<key>",
    lock_enqueue="raise",
)
def queued_retry(self: Any, key: str, seconds: float, record_to: str) -> None:
    """Works ``seconds``, re-publishes itself (``retry(throw=False)``: the copy is queued while
    this run goes on holding the key), works ``seconds`` more, and ends: its key is then handed
    to the copy's marker. The copy does nothing. Its name contains "queued", as a marker's
    holder record does."""
    if self.request.retries:
        return
    record(record_to, event="start", key=key, task_id=self.request.id)
    time.sleep(seconds)
    self.retry(countdown=0, throw=False)
    time.sleep(seconds)
    record(record_to, event="end", key=key, task_id=self.request.id)


# A publisher that stops between taking its marker and handing the message to the broker: with
# ENQUEUEAPP_BLOCK_PUBLISH set to a directory, every publish writes "<dir>/ready" (its pid) in
# ``before_task_publish`` (sent after the marker is placed, before the broker sees the message)
# and then waits for "<dir>/go", which the test never writes: it kills the process there.
_BLOCK = os.environ.get("ENQUEUEAPP_BLOCK_PUBLISH")
if _BLOCK:
    from celery.signals import before_task_publish

    @before_task_publish.connect(weak=False)
    def _block_publish(**_: Any) -> None:
        ready = os.path.join(_BLOCK, "ready")
        with open(ready + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.replace(ready + ".tmp", ready)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(os.path.join(_BLOCK, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)
