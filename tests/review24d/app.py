"""The Celery app of the issue 24 (d) review (``celery -A tests.review24d.app``).

Configured from the environment: ``R24D_BROKER``, ``R24D_BACKEND`` (a server of its own, so a
test can stop it alone), ``R24D_MASTERS``. Every task locks ``r24d:<key>``.
"""

from __future__ import annotations

from typing import Any

from celery_redlock import RedlockTask

from ..workerapp import worker_app

app = worker_app("review24d", "R24D")


@app.task(
    bind=True,
    base=RedlockTask,
    name="r24d.marked",
    lock_key="r24d:<key>",
    lock_contended="retry",
    lock_retry_backoff=0.25,
    lock_retry_backoff_max=1.0,
    lock_enqueue="return_existing",
)
def marked(self: Any, key: str) -> str:
    return key
