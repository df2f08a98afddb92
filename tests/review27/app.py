"""The Celery app of the issue 27 review (``celery -A tests.review27.app``).

Configured from the environment: ``R27_BROKER`` (also the result backend and the run records),
``R27_MASTERS``. The one task locks ``r27:<key>``, deduplicates at publish and waits for a
taken lock; each run records its task id on the broker's list ``r27:runs:<key>``.
"""

from __future__ import annotations

from typing import Any

from celery_redlock import RedlockTask

from ..workerapp import Records, worker_app

app = worker_app("review27", "R27")
records = Records("R27_BROKER")


@app.task(
    bind=True,
    base=RedlockTask,
    name="r27.waiting",
    lock_key="r27:<key>",
    lock_enqueue="return_existing",
    lock_contended="wait",
)
def waiting(self: Any, key: str) -> str:
    records().rpush(f"r27:runs:{key}", self.request.id)
    return key
