"""The Celery app of the lost-work tests' real workers (``celery -A tests.enqueue_lost.app``).

Configured from the environment: ``ELOST_BROKER``, ``ELOST_BACKEND``, ``ELOST_RECORDS`` (where
the bodies write what they saw) and ``ELOST_MASTERS`` (the lock masters; the workers reach them
through the test's proxies). Every task locks ``lost:<key>``; events go to the Redis list
``elost:<key>``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery_redlock import RedlockTask
from celery_redlock.celery import signals as lock_signals

from ..workerapp import Records, worker_app

app = worker_app("enqueue_lost", "ELOST")
records = Records("ELOST_RECORDS")


def record(key: str, event: str, **fields: Any) -> None:
    key = key.removeprefix("lost:")
    fields.setdefault("t", time.time())
    records().rpush(f"elost:{key}", json.dumps({"event": event, "key": key, "pid": os.getpid(), **fields}))


def events(key: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in records().lrange(f"elost:{key}", 0, -1)]


@app.task(
    bind=True,
    base=RedlockTask,
    name="elost.deduped",
    lock_key="lost:<key>",
    lock_contended="retry",
    lock_retry_backoff=0.25,
    lock_retry_backoff_max=1.0,
    lock_enqueue="return_existing",
)
def deduped(self: Any, key: str, seconds: float = 0.0) -> str:
    """Records its start, holds the lock ``seconds``, records its end."""
    record(key, "start", task_id=self.request.id, retries=self.request.retries)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    record(key, "end", task_id=self.request.id)
    return key


@lock_signals.lock_contended.connect
def _note_refused(
    sender: Any = None, key: str = "", task_id: str = "", policy: str = "", error: Any = None, **_: Any
) -> None:
    if str(getattr(sender, "name", "")).startswith("elost."):
        record(key, "refused", task_id=task_id, policy=policy, error=str(error)[:400])
