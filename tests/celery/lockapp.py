"""The Celery app the tests' real workers run (``celery -A lockapp worker``).

Configured from the environment, so the worker subprocesses and the test process build the same
app: ``LOCKAPP_BROKER`` (broker URL), ``LOCKAPP_BACKEND`` (result backend and the records store,
a Redis URL), ``LOCKAPP_MASTERS`` (comma-separated lock master URLs, may be empty).

Every task records what it saw as JSON on a Redis list named by its ``record`` argument, with
``CLOCK_MONOTONIC`` times, which are system-wide on Linux and so comparable across processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject

from celery_redlock import LockLost, RedlockTask, RedlockTaskMixin
from celery_redlock.celery import signals as lock_signals

BROKER = os.environ.get("LOCKAPP_BROKER", "redis://127.0.0.1:1/0")
BACKEND = os.environ.get("LOCKAPP_BACKEND", "redis://127.0.0.1:1/0")

app = Celery("lockapp", broker=BROKER, backend=BACKEND)
app.conf.update(
    redlock_masters=os.environ.get("LOCKAPP_MASTERS") or None,
    redlock_ttl=5.0,
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.3,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("LOCKAPP_QUEUE", "lockapp"),
)

_store: redis.Redis | None = None
_store_pid = 0


def store() -> redis.Redis:
    """A client for the records store, one per process."""
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


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", name="lockapp.hold")
def hold(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Hold ``key`` for ``seconds``; record the interval."""
    start = now()
    record(record_to, event="start", key=key, task_id=self.request.id, start=start)
    time.sleep(seconds)
    assert self.redlock is not None
    owned = self.redlock.owned()
    record(
        record_to,
        event="interval",
        key=key,
        task_id=self.request.id,
        start=start,
        end=now(),
        owned=owned,
        retries=self.request.retries,
    )
    return key


@app.task(
    bind=True, base=RedlockTask, lock_key="res:<key>", lock_contended="skip", name="lockapp.hold_or_skip"
)
def hold_or_skip(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    start = now()
    time.sleep(seconds)
    record(record_to, event="interval", key=key, task_id=self.request.id, start=start, end=now())
    return key


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", name="lockapp.gives_up")
def gives_up(self: RedlockTask, key: str, how: str, record_to: str) -> None:
    """Take the lock, then end the run with Ignore or Reject, which skip after_return."""
    assert self.redlock is not None and self.redlock.owned()
    record(record_to, event="holding", key=key, task_id=self.request.id)
    if how == "ignore":
        raise Ignore()
    raise Reject("given up", requeue=False)


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", lock_ttl=0.6, name="lockapp.long_hold")
def long_hold(self: RedlockTask, key: str, seconds: float, record_to: str) -> dict[str, Any]:
    """Run many times the TTL, checking the lock is owned throughout."""
    start = now()
    record(record_to, event="start", key=key, task_id=self.request.id, start=start)
    lowest = None
    deadline = start + seconds
    while now() < deadline:
        assert self.redlock is not None
        self.redlock.ensure()
        validity = self.redlock.validity
        lowest = validity if lowest is None else min(lowest, validity)
        time.sleep(0.05)
    record(
        record_to,
        event="interval",
        key=key,
        task_id=self.request.id,
        start=start,
        end=now(),
        lowest_validity=lowest,
    )
    return {"lowest_validity": lowest}


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", name="lockapp.hold_until")
def hold_until(self: RedlockTask, key: str, flag: str, limit: float, record_to: str) -> str:
    """Hold ``key`` until the store has ``flag`` (a test's event, not a duration), at most ``limit`` s."""
    start = now()
    record(record_to, event="start", key=key, task_id=self.request.id, start=start)
    while not store().exists(flag) and now() < start + limit:
        time.sleep(0.02)
    record(record_to, event="interval", key=key, task_id=self.request.id, start=start, end=now())
    return key


@app.task(
    bind=True, base=RedlockTask, lock_key="res:<key>", lock_ttl=1.0, time_limit=3, name="lockapp.limited"
)
def limited(self: RedlockTask, key: str, seconds: float, record_to: str) -> dict[str, Any]:
    """A task whose own time limit (3 s) a call may raise; the body checks its lock throughout."""
    start = now()
    record(record_to, event="start", key=key, task_id=self.request.id, start=start)
    lost = ""
    while now() < start + seconds:
        try:
            self.redlock.ensure()
        except LockLost as exc:
            lost = str(exc)
            break
        time.sleep(0.05)
    record(record_to, event="interval", key=key, task_id=self.request.id, start=start, end=now(), lost=lost)
    return {"lost": lost}


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", lock_ttl=1.0, name="lockapp.until_lost")
def until_lost(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Poll ``self.redlock`` until the lock is lost (or ``seconds`` pass); record what was seen."""
    record(
        record_to,
        event="start",
        key=key,
        task_id=self.request.id,
        token=self.redlock.token if self.redlock else None,
    )
    deadline = now() + seconds
    lock = self.redlock
    assert lock is not None
    while now() < deadline and lock.owned():
        time.sleep(0.02)
    try:
        lock.ensure()
        seen = ""
    except LockLost as exc:
        seen = str(exc)
    record(record_to, event="seen", key=key, task_id=self.request.id, lost=seen, reason=lock.lost_reason)
    return seen


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="res:<key>",
    lock_max_retries=5,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.2,
    name="lockapp.bounded",
)
def bounded(self: RedlockTask, key: str, record_to: str) -> str:
    record(record_to, event="ran", key=key, task_id=self.request.id)
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="res:<key>",
    lock_contended="fail",
    max_retries=1,
    name="lockapp.own_retry",
)
def own_retry(self: RedlockTask, key: str, record_to: str) -> int:
    """Uses the task's own retry budget once; the lock must be free again for the retried run."""
    record(record_to, event="run", key=key, task_id=self.request.id, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return int(self.request.retries)


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", max_retries=1, name="lockapp.waits_then_retries")
def waits_then_retries(self: RedlockTask, key: str, record_to: str) -> int:
    """Waits for the lock by lock retries, then spends its own single retry; records the lock
    attempt count each run carries, which must start afresh for the task's own retry."""
    attempt = getattr(self.request, "redlock_attempt", None)
    if attempt is None:
        attempt = (self.request.headers or {}).get("redlock_attempt")
    record(record_to, event="run", key=key, retries=self.request.retries, attempt=attempt or 0)
    if self.request.retries == 0:
        # Later than the release at the end of this run: the retried run finds the lock free.
        raise self.retry(countdown=1.0)
    return int(self.request.retries)


class Audited(Task):  # type: ignore[misc]
    """A user's own base class with lifecycle hooks of its own, for the mixin test."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        record(args[1], event="base-before", task_id=task_id)

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        record(args[1], event="base-after", task_id=task_id, status=status)


class AuditedLocked(RedlockTaskMixin, Audited):  # type: ignore[misc]
    pass


@app.task(bind=True, base=AuditedLocked, lock_key="res:<key>", name="lockapp.mixed")
def mixed(self: AuditedLocked, key: str, record_to: str) -> str:
    assert self.redlock is not None
    record(record_to, event="body", owned=self.redlock.owned(), token=self.redlock.token)
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="slot:<key>",
    lock_slot=60.0,
    lock_release="on_expiry",
    lock_contended="skip",
    lock_ttl=60.0,  # a period: copies of one tick may arrive that far apart (check_app says so)
    name="lockapp.per_slot",
)
def per_slot(self: RedlockTask, key: str, record_to: str) -> str:
    """Once per 60 s slot: the lock outlives the run, so a late duplicate of the slot is skipped."""
    assert self.redlock is not None
    record(record_to, event="ran", key=key, task_id=self.request.id, lock=self.redlock.name)
    return self.redlock.name


def free_for_others(key: str) -> bool:
    """Whether another client could take ``res:<key>`` right now (it releases at once if so)."""
    from celery_redlock import Redlock

    masters = app.conf.redlock_masters
    urls = masters.split(",") if isinstance(masters, str) else list(masters)
    with Redlock(urls, retry_count=0) as other:
        lock = other.lock(f"res:{key}", ttl=5)
        if lock.acquire(blocking=False):
            lock.release()
            return True
    return False


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", max_retries=0, name="lockapp.retry_fallback")
def retry_fallback(self: RedlockTask, key: str, record_to: str) -> str:
    """Celery refuses the retry (max_retries=0): the fallback must still run under the lock."""
    try:
        self.retry(countdown=0)
    except MaxRetriesExceededError:
        record(record_to, event="fallback", owned=self.redlock.owned(), free=free_for_others(key))
    return "fallback"


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", max_retries=1, name="lockapp.retry_no_throw")
def retry_no_throw(self: RedlockTask, key: str, record_to: str) -> int:
    """``retry(throw=False)`` returns into the body, which goes on under the lock."""
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False)
        record(record_to, event="after-retry", owned=self.redlock.owned(), free=free_for_others(key))
    else:
        record(record_to, event="retried", task_id=self.request.id)
    return int(self.request.retries)


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="res:<key>",
    lock_contended="skip",
    lock_ttl=10.0,  # longer than the worker takes to see the loss and requeue the message, loaded
    acks_late=True,
    reject_on_worker_lost=True,
    name="lockapp.crash_once",
)
def crash_once(self: RedlockTask, key: str, record_to: str) -> str:
    """The first delivery kills its pool process while holding the lock; the broker redelivers
    the same task id, which must run (not be skipped as a duplicate) once the lock is gone."""
    first = store().rpush(f"{record_to}:deliveries", self.request.id) == 1
    record(record_to, event="run", key=key, task_id=self.request.id, first=first)
    if first:
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="res:<key>",
    lock_contended="skip",
    ignore_result=True,
    name="lockapp.skip_quietly",
)
def skip_quietly(self: RedlockTask, key: str, record_to: str) -> str:
    record(record_to, event="ran", key=key)
    return "ran"


@app.task(name="lockapp.collect")
def collect(values: Any) -> Any:
    """A plain chord body / chain link: returns what it was given."""
    return values


@lock_signals.lock_contended.connect
def _on_contended(
    sender: Any = None,
    key: str = "",
    task_id: str = "",
    policy: str = "",
    attempt: int = 0,
    countdown: float = 0.0,
    error: Any = None,
    **_: Any,
) -> None:
    """Each contended run's decision; ``contended`` is False where no quorum could be decided
    for want of replies (unavailability, retried whatever the task's mode)."""
    contended = bool(getattr(error, "contended", True))
    record(
        "signals:contended",
        key=key,
        task_id=task_id,
        policy=policy,
        attempt=attempt,
        countdown=countdown,
        contended=contended,
    )


@lock_signals.lock_lost.connect
def _on_lost(sender: Any = None, key: str = "", task_id: str = "", reason: str = "", **_: Any) -> None:
    record("signals:lost", key=key, task_id=task_id, reason=reason)


@app.task(bind=True, base=RedlockTask, lock_key="res:<key>", lock_ttl=1.0, name="lockapp.spin")
def spin(
    self: RedlockTask, key: str, seconds: float, yield_every: float, pause: float, record_to: str
) -> str:
    """A CPU-bound body: busy for ``seconds`` without waiting on anything, except that every
    ``yield_every`` seconds (never if 0) it sleeps ``pause`` seconds, which under gevent or
    eventlet is their own sleep, letting the other green threads run; then record whether the
    lock was kept."""
    assert self.redlock is not None
    start = now()
    record(record_to, event="start", key=key, task_id=self.request.id, start=start)
    next_yield = start + yield_every if yield_every else float("inf")
    deadline = start + seconds
    while (current := now()) < deadline:
        if current >= next_yield:
            time.sleep(pause)
            next_yield = now() + yield_every
    try:
        self.redlock.ensure()
        lost = ""
    except LockLost as exc:
        lost = str(exc)
    record(record_to, event="end", key=key, task_id=self.request.id, start=start, end=now(), lost=lost)
    return lost


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="res:<key>",
    lock_contended="wait",
    lock_wait_timeout=20.0,
    lock_retry_backoff=5.0,  # a run that fell back to a retry would show in the drain time
    lock_retry_backoff_max=5.0,
    name="lockapp.hold_or_wait",
)
def hold_or_wait(self: RedlockTask, key: str, seconds: float, record_to: str) -> str:
    """Hold ``key`` for ``seconds`` after waiting in the worker for it; records the interval and
    the lock attempt the run carries (0 unless it fell back to a retry)."""
    start = now()
    time.sleep(seconds)
    attempt = getattr(self.request, "redlock_attempt", None)
    if attempt is None:
        attempt = (self.request.headers or {}).get("redlock_attempt")
    assert self.redlock is not None
    record(
        record_to,
        event="interval",
        key=key,
        task_id=self.request.id,
        start=start,
        end=now(),
        owned=self.redlock.owned(),
        attempt=attempt or 0,
    )
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    lock_key="res:<key>",
    lock_contended="wait",
    lock_wait_timeout=0.5,
    lock_max_retries=1,
    lock_retry_backoff=0.1,
    lock_retry_backoff_max=0.1,
    name="lockapp.wait_briefly",
)
def wait_briefly(self: RedlockTask, key: str, record_to: str) -> str:
    """Waits at most 0.5 s per attempt, and has one lock retry: against a long holder it fails."""
    record(record_to, event="ran", key=key, task_id=self.request.id)
    return key


def charge_service(key: str, record_to: str) -> None:
    """A service function a task calls: it takes the resource's lock itself, as it would when
    called from elsewhere; inside a lock_reentrant task it re-enters the task's own lock."""
    from celery_redlock import app_redlock

    with app_redlock(app).lock(f"res:{key}", ttl=5, reentrant=True) as lock:
        record(record_to, event="service", key=key, depth=lock.depth, owned=lock.owned())
        time.sleep(0.1)


@app.task(
    bind=True, base=RedlockTask, lock_key="res:<key>", lock_reentrant=True, name="lockapp.reentrant_job"
)
def reentrant_job(self: RedlockTask, key: str, record_to: str) -> str:
    start = now()
    charge_service(key, record_to)
    assert self.redlock is not None
    record(
        record_to,
        event="interval",
        key=key,
        task_id=self.request.id,
        start=start,
        end=now(),
        owned=self.redlock.owned(),
    )
    return key
