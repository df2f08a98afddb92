"""A job many times longer than its lock's TTL, kept alive by the heartbeat.

The lock's TTL is short (2 s) so that a worker that dies frees the ledger quickly; the process
heartbeat extends it every TTL/3 while the body runs. The body checks ``self.redlock.ensure()``
before every step that writes: if the lock was lost (a majority of masters unreachable, or the
process paused for longer than the TTL), another worker may already hold it, so the job stops
with ``LockLost`` instead of writing. Every step is idempotent, so a later run can resume.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_redlock import RedlockTask

app = Celery("long_running")
app.conf.broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
app.conf.result_backend = os.environ.get("CELERY_RESULT_BACKEND", "rpc://")
app.conf.redlock_masters = os.environ.get("REDLOCK_MASTERS", "")
app.conf.broker_connection_retry_on_startup = True


@app.task(bind=True, base=RedlockTask, lock_key="ledger:<ledger>", lock_ttl=2.0, lock_contended="fail")
def reconcile(self: Any, ledger: str, steps: int = 10, step_seconds: float = 0.5) -> str:
    for step in range(1, steps + 1):
        time.sleep(step_seconds)  # one batch of work, here a quarter of the TTL
        self.redlock.ensure()  # raises LockLost: stop before writing anything more
        self.update_state(state="PROGRESS", meta={"step": step, "validity": self.redlock.validity})
    return f"reconciled {ledger} in {steps} steps ({steps * step_seconds:.1f}s under a 2.0s TTL)"
