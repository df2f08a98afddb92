"""The Celery app of the review46 after_return tests (``celery -A tests.review46.app``).

``R46_BROKER`` is the broker, the result backend and the records; ``R46_MASTERS`` the lock
masters. Every locked task locks ``r46:<key>`` for 30 s (so a contender that gets in soon after
a run ended was let in by a release, not by expiry); bodies record ``start`` and ``end`` events on
the Redis list ``r46:<key>``."""

from __future__ import annotations

import time
from typing import Any

from celery import signals
from celery.exceptions import Ignore, Reject

from celery_redlock import RedlockTask
from tests.workerapp import EventLog, Records, worker_app

app = worker_app("r46", "R46", redlock_ttl=30.0)
records = Records("R46_BROKER")
log = EventLog(records, "r46:")
record, events = log.record, log.events


def _note_postrun(task_id: str, task: Any, args: Any = (), **_: Any) -> None:
    """Connected before any locked task is defined, so before celery_redlock's own postrun hook
    (its backstop release): whether the run's lock was still registered as postrun began, i.e.
    whether after_return released it."""
    from celery_redlock.celery import held

    if getattr(task, "name", "") == "r46.refused" and args:
        record(str(args[0]), "postrun", held=task_id in held._held)


signals.task_postrun.connect(_note_postrun, weak=False)

LOCKED = {"base": RedlockTask, "lock_key": "r46:<key>", "lock_ttl": 30.0, "bind": True}


def _body(task: Any, key: str, seconds: float = 0.0) -> None:
    record(key, "start", task_id=task.request.id, retries=task.request.retries)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    record(key, "end", task_id=task.request.id, retries=task.request.retries)


@app.task(name="r46.ok", lock_contended="wait", lock_wait_timeout=30.0, **LOCKED)
def ok(self: Any, key: str, seconds: float = 0.0) -> str:
    _body(self, key, seconds)
    return key


@app.task(name="r46.boom", **LOCKED)
def boom(self: Any, key: str) -> None:
    _body(self, key)
    raise ValueError(f"boom {key}")


@app.task(name="r46.ignored", **LOCKED)
def ignored(self: Any, key: str) -> None:
    _body(self, key)
    raise Ignore()


@app.task(name="r46.rejected", **LOCKED)
def rejected(self: Any, key: str) -> None:
    _body(self, key)
    raise Reject("no", requeue=False)


@app.task(name="r46.own_retry", max_retries=1, **LOCKED)
def own_retry(self: Any, key: str) -> str:
    _body(self, key)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return key


@app.task(name="r46.plain", bind=True)
def plain(self: Any, key: str) -> str:
    record(key, "plain", task_id=self.request.id)
    return key


@app.task(name="r46.replaced", **LOCKED)
def replaced(self: Any, key: str) -> Any:
    _body(self, key)
    queue = (self.request.delivery_info or {}).get("routing_key")
    raise self.replace(plain.si(key).set(queue=queue) if queue else plain.si(key))


@app.task(
    name="r46.contended",
    lock_contended="retry",
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=0.3,
    lock_max_retries=50,
    **LOCKED,
)
def contended(self: Any, key: str) -> str:
    _body(self, key)
    return key


class FailsAfterAcquiring(RedlockTask):  # type: ignore[misc]
    """A base whose before_start takes the lock (the mixin's) and then refuses the run: the body
    never runs, so only after_return (and task_postrun) can release."""

    abstract = True

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        super().before_start(task_id, args, kwargs)
        key = args[0] if args else kwargs["key"]
        record(key, "acquired", task_id=task_id)
        hold = args[1] if len(args) > 1 else 0.0
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            time.sleep(0.02)
        raise RuntimeError(f"refused after acquiring {key}")


@app.task(name="r46.refused", base=FailsAfterAcquiring, lock_key="r46:<key>", lock_ttl=30.0, bind=True)
def refused(self: Any, key: str, hold: float = 0.0) -> None:
    record(key, "body", task_id=self.request.id)
