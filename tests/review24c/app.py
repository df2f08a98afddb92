"""The Celery app of the issue 24 (c) review's real workers (``celery -A tests.review24c.app``).

Configured from the environment: ``R24_BROKER``, ``R24_BACKEND``, ``R24_RECORDS``,
``R24_MASTERS``. ``R24_REQUEST_TIMEOUT`` sets ``redlock_request_timeout``; ``R24_TIME_LIMIT``
the app-wide ``task_time_limit``; with ``R24_OLD_DEPLOY=1`` the marked tasks are not registered
(a worker of another deploy). Every task locks ``r24:<key>``; events go to the Redis list
``r24:<key>`` of the records store.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_redlock import RedlockTask

from ..workerapp import EventLog, Records, worker_app

app = worker_app("review24c", "R24")
if os.environ.get("R24_REQUEST_TIMEOUT"):
    app.conf.redlock_request_timeout = float(os.environ["R24_REQUEST_TIMEOUT"])
if os.environ.get("R24_TIME_LIMIT"):
    app.conf.task_time_limit = float(os.environ["R24_TIME_LIMIT"])

records = Records("R24_RECORDS")


log = EventLog(records, "r24:")
record, events = log.record, log.events
log.note_preruns()


def _hold(task: Any, key: str, seconds: float) -> str:
    record(key, "start", task_id=task.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    record(key, "end", task_id=task.request.id)
    return key


@app.task(
    bind=True, base=RedlockTask, name="r24.slow", lock_key="r24:<key>", lock_contended="fail", time_limit=60
)
def slow(self: Any, key: str, seconds: float) -> str:
    """Holds ``r24:<key>`` for ``seconds``: another task, whose hold makes a marked run wait."""
    return _hold(self, key, seconds)


if os.environ.get("R24_OLD_DEPLOY") != "1":

    @app.task(
        bind=True,
        base=RedlockTask,
        name="r24.marked",
        lock_key="r24:<key>",
        lock_contended="retry",
        lock_retry_backoff=0.25,
        lock_retry_backoff_max=1.0,
        lock_enqueue="return_existing",
    )
    def marked(self: Any, key: str, seconds: float = 0.0) -> str:
        return _hold(self, key, seconds)

    @app.task(
        bind=True,
        base=RedlockTask,
        name="r24.expiring",
        lock_key="r24:<key>",
        lock_contended="retry",
        lock_retry_backoff=0.25,
        lock_retry_backoff_max=1.0,
        lock_enqueue="return_existing",
        expires=1.0,  # the task's own: every message of it expires a second after its publish
    )
    def expiring(self: Any, key: str, seconds: float = 0.0) -> str:
        return _hold(self, key, seconds)

    @app.task(
        bind=True,
        base=RedlockTask,
        name="r24.marked_wait",
        lock_key="r24:<key>",
        lock_contended="wait",
        lock_wait_timeout=30.0,
        lock_retry_backoff=0.25,
        lock_retry_backoff_max=1.0,
        lock_enqueue="return_existing",
    )
    def marked_wait(self: Any, key: str, seconds: float = 0.0) -> str:
        return _hold(self, key, seconds)
