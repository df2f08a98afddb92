"""The Celery app of the marker-ends and warning tests' real workers (``celery -A endsapp``).

Configured from the environment: ``ENDS_BROKER`` (also the result backend and the records),
``ENDS_MASTERS`` (the lock masters; the warning tests' workers reach them through proxies).
Every task locks ``e:<key>``; events go to the Redis list ``ends:<key>``.

With ``ENDS_OLD_DEPLOY=1`` the marked tasks are not registered: a worker of another deploy
(one that runs celery_redlock, with other locked tasks) reading the same queue.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_redlock import RedlockTask
from tests.workerapp import EventLog, Records, worker_app

app = worker_app("endsapp", "ENDS")
records = Records("ENDS_BROKER")


log = EventLog(records, "ends:")
record, events = log.record, log.events
log.note_preruns()


def _hold(task: Any, key: str, seconds: float) -> str:
    record(key, "start", task_id=task.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    record(key, "end", task_id=task.request.id)
    return key


@app.task(bind=True, base=RedlockTask, name="ends.slow", lock_key="e:<key>", lock_contended="fail")
def slow(self: Any, key: str, seconds: float) -> str:
    """Holds ``e:<key>`` for ``seconds``: another task, whose hold makes a marked run wait."""
    return _hold(self, key, seconds)


if os.environ.get("ENDS_OLD_DEPLOY") != "1":

    @app.task(
        bind=True,
        base=RedlockTask,
        name="ends.marked",
        lock_key="e:<key>",
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
        name="ends.marked_wait",
        lock_key="e:<key>",
        lock_contended="wait",
        lock_wait_timeout=30.0,
        lock_retry_backoff=0.25,
        lock_retry_backoff_max=1.0,
        lock_enqueue="return_existing",
    )
    def marked_wait(self: Any, key: str, seconds: float = 0.0) -> str:
        return _hold(self, key, seconds)
