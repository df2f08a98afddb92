"""The Celery app of review47 (``celery -A tests.review47.app``): ``R47_BROKER`` is the broker,
the result backend and the records; ``R47_MASTERS`` the lock masters. Every locked task locks
``r47:<key>`` for 30 s, so a contender let in soon after a run was let in by a release."""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore, Reject

from celery_redlock import RedlockTask
from tests.workerapp import EventLog, Records, worker_app

app = worker_app("r47", "R47", redlock_ttl=30.0)
records = Records("R47_BROKER")
log = EventLog(records, "r47:")
record, events = log.record, log.events

LOCKED = {"base": RedlockTask, "lock_key": "r47:<key>", "lock_ttl": 30.0, "bind": True}


def _ran(task: Any, key: str) -> None:
    record(key, "run", task_id=task.request.id, retries=task.request.retries)


@app.task(name="r47.link", lock_contended="skip", **LOCKED)
def link(self: Any, key: str, n: int) -> int:
    _ran(self, key)
    return n


@app.task(name="r47.failing_fast", lock_contended="fail", **LOCKED)
def failing_fast(self: Any, key: str) -> str:
    _ran(self, key)
    return key


@app.task(name="r47.boom", lock_contended="fail", **LOCKED)
def boom(self: Any, key: str) -> None:
    _ran(self, key)
    raise ValueError(key)


@app.task(name="r47.ignored", lock_contended="fail", **LOCKED)
def ignored(self: Any, key: str) -> None:
    _ran(self, key)
    raise Ignore()


@app.task(name="r47.rejected", lock_contended="fail", **LOCKED)
def rejected(self: Any, key: str) -> None:
    _ran(self, key)
    raise Reject("no", requeue=False)


@app.task(name="r47.retried", lock_contended="fail", max_retries=2, **LOCKED)
def retried(self: Any, key: str) -> str:
    _ran(self, key)
    if self.request.retries < 2:
        raise self.retry(countdown=0)
    return key


@app.task(name="r47.inner", lock_contended="fail", **LOCKED)
def inner(self: Any, key: str) -> str:
    _ran(self, key)
    return key


@app.task(name="r47.outer", lock_contended="fail", **LOCKED)
def outer(self: Any, key: str, inner_key: str, fail_inner: bool = False) -> str:
    _ran(self, key)
    inner.apply((inner_key,))
    if fail_inner:
        boom.apply((inner_key + "-b",))
    return key
