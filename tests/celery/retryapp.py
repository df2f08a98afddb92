"""The Celery app of the lock-retry tests' real workers (``celery -A retryapp``).

Its result backend is real Redis (the broker's, unless ``RETRY_BACKEND`` names another, such as
a port where nothing listens), with one change: a run's RETRY state reaches the server
``RETRY_STORE_DELAY`` seconds after the backend read what was stored before it (default 0), as
on a backend that is loaded or far away.
``RETRY_BROKER`` is the broker, which also keeps the run log; ``RETRY_MASTERS`` the lock masters.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery.backends.redis import RedisBackend

from celery_redlock import RedlockTask
from tests.workerapp import worker_app

BROKER = os.environ.get("RETRY_BROKER", "redis://127.0.0.1:1/0")
BACKEND = os.environ.get("RETRY_BACKEND") or BROKER
RETRY_STORE_DELAY = float(os.environ.get("RETRY_STORE_DELAY", "0"))


class SlowRetryStore(RedisBackend):  # type: ignore[misc]
    def _set_with_state(self, key: str, value: Any, state: str) -> Any:
        # Late between the backend's read of the stored state and its write: a RETRY written
        # then lands over whatever another run stored meanwhile, SUCCESS included.
        if state == "RETRY":
            time.sleep(RETRY_STORE_DELAY)
        return super()._set_with_state(key, value, state)


app = worker_app(
    "retryapp",
    "RETRY",
    backend=f"{__name__}.SlowRetryStore+{BACKEND}",
    # A backend that is down fails fast instead of after Celery's 20 reconnects.
    result_backend_transport_options={
        "retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}
    },
)

LOCK: dict[str, Any] = dict(
    lock_contended="retry",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.05,
    lock_max_retries=1000,
)


def note(key: str, task_id: str) -> None:
    """Every run of a body is logged, in the broker's Redis."""
    redis.Redis.from_url(BROKER).rpush(f"retry:runs:{key}", task_id)


def runs(key: str) -> list[str]:
    return [v.decode() for v in redis.Redis.from_url(BROKER).lrange(f"retry:runs:{key}", 0, -1)]


def stored_state(task_id: str) -> str:
    """The state the backend holds now (an AsyncResult keeps the first ready state it read)."""
    backend = app.backend
    raw = backend.client.get(backend.get_key_for_task(task_id))
    return "PENDING" if raw is None else str(backend.decode_result(raw)["status"])


@app.task(base=RedlockTask, bind=True, name="retry.step", lock_key="retry:<key>", **LOCK)
def step(self: Any, key: str, seconds: float, fail: bool = False) -> str:
    note(key, self.request.id)
    time.sleep(seconds)
    if fail:
        raise ValueError(f"step {key} failed, as it was asked to")
    return key


class OnRetryRaises(RedlockTask):
    """A user's base whose on_retry handler raises (a metrics call, a notifier that is down)."""

    abstract = True

    def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        raise RuntimeError("the user's on_retry handler failed")


@app.task(base=OnRetryRaises, bind=True, name="retry.step_on_retry_raises", lock_key="retry:<key>", **LOCK)
def step_on_retry_raises(self: Any, key: str, seconds: float) -> str:
    note(key, self.request.id)
    time.sleep(seconds)
    return key


@app.task(base=RedlockTask, bind=True, name="retry.own_retry", lock_key="retry:<key>", **LOCK)
def own_retry(self: Any, key: str, seconds: float) -> str:
    """Retries itself once with Celery's self.retry() (after its lock retries, if any)."""
    note(key, self.request.id)
    time.sleep(seconds)
    if self.request.retries == 0:
        raise self.retry(countdown=0, max_retries=3)
    return key


@app.task(base=RedlockTask, bind=True, name="retry.own_retry_swallowed", lock_key="retry:<key>", **LOCK)
def own_retry_swallowed(self: Any, key: str) -> str:
    """Raises ``self.retry()`` once inside a broad ``except Exception`` (``Retry`` is one), which
    swallows it: the run succeeds, and Celery has asked for the copy all the same."""
    note(key, self.request.id)
    if self.request.retries == 0:
        try:
            raise self.retry(countdown=0, max_retries=3)
        except Exception:
            return "swallowed"
    return key


@app.task(
    base=RedlockTask, bind=True, name="retry.step_ignored", lock_key="retry:<key>", ignore_result=True, **LOCK
)
def step_ignored(self: Any, key: str, seconds: float) -> str:
    note(key, self.request.id)
    time.sleep(seconds)
    return key


@app.task(bind=True, name="retry.after")
def after(self: Any, value: Any, key: str) -> Any:
    note(key, "after:" + str(value))
    return value
