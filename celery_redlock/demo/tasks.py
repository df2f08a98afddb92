"""The Celery app the demo's workers run: ``charge_invoice`` under a Redlock per invoice.

Shipped inside the package so that ``celery -A celery_redlock.demo.tasks worker`` works from any
directory. Configured from the environment the demo gives its workers:

- ``CELERY_REDLOCK_DEMO_BROKER``: the broker URL;
- ``CELERY_REDLOCK_DEMO_MASTERS``: the lock masters, comma-separated redis URLs;
- ``CELERY_REDLOCK_DEMO_LEDGER``: the directory each process writes what it saw to;
- ``CELERY_REDLOCK_DEMO_WORK``: how long one charge takes, in seconds;
- ``CELERY_REDLOCK_DEMO_CONTENDED``: what a duplicate does while the invoice is locked
  (``retry``: wait its turn; ``skip``: give up).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from celery import Celery, Task
from celery.signals import task_postrun, task_retry

from ..celery import signals
from ..celery.task import RedlockTask
from .ledger import LedgerWriter

ENV_BROKER = "CELERY_REDLOCK_DEMO_BROKER"
ENV_MASTERS = "CELERY_REDLOCK_DEMO_MASTERS"
ENV_LEDGER = "CELERY_REDLOCK_DEMO_LEDGER"
ENV_WORK = "CELERY_REDLOCK_DEMO_WORK"
ENV_CONTENDED = "CELERY_REDLOCK_DEMO_CONTENDED"

TASK_NAME = "celery_redlock.demo.charge_invoice"
LOCK_TTL = 5.0

WORK = float(os.environ.get(ENV_WORK, "0.05"))
CONTENDED = os.environ.get(ENV_CONTENDED, "retry")

app = Celery("celery_redlock_demo")
app.conf.update(
    broker_url=os.environ.get(ENV_BROKER, "redis://127.0.0.1:6379/15"),
    broker_connection_retry_on_startup=True,
    redlock_masters=[u for u in os.environ.get(ENV_MASTERS, "").split(",") if u],
    redlock_ttl=LOCK_TTL,
    # A charge takes tens of milliseconds: a waiting duplicate should look again that soon.
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=1.0,
    task_ignore_result=True,
    # Its own queue, so on a shared real broker the demo neither eats nor is fed others' messages.
    task_default_queue="celery_redlock_demo",
    # One message at a time per pool process, so duplicates spread over the whole fleet.
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)

_ledger = LedgerWriter(os.environ.get(ENV_LEDGER, "."))
# How long each execution's lock acquisition took, from the lock_acquired signal to its body.
_acquired: dict[str, float] = {}
_started_lock = threading.Lock()


def _charge_invoice(self: Task, invoice_id: int) -> None:
    """Charge one invoice: only safe while no other process charges it at the same time."""
    start = time.monotonic()
    with _started_lock:
        acquire = _acquired.pop(self.request.id, 0.0)
    time.sleep(WORK)  # the payment provider's round trip
    self.redlock.ensure()  # LockLost here means the charge must not be recorded
    _ledger.write(
        "run",
        task_id=self.request.id,
        resource=f"invoice:{invoice_id}",
        start=start,
        end=time.monotonic(),
        acquire=acquire,
    )


def _note_acquired(sender: Any = None, task_id: str | None = None, elapsed: float = 0.0, **_: Any) -> None:
    if getattr(sender, "name", None) == TASK_NAME and task_id is not None:
        with _started_lock:
            _acquired[task_id] = elapsed


def _note_retry(request: Any = None, **_: Any) -> None:
    if request is not None and getattr(request, "task", None) == TASK_NAME:
        _ledger.write("retry", task_id=request.id)


def _note_end(task_id: str | None = None, task: Any = None, state: str | None = None, **_: Any) -> None:
    if getattr(task, "name", None) == TASK_NAME and task_id is not None:
        with _started_lock:
            _acquired.pop(task_id, None)
        _ledger.write("done", task_id=task_id, state=state or "")


# Applied as calls rather than decorators: Celery is untyped, and a decorator would erase the types.
charge_invoice = app.task(
    _charge_invoice,
    base=RedlockTask,
    bind=True,
    name=TASK_NAME,
    lock_key="invoice:<invoice_id>",
    lock_ttl=LOCK_TTL,
    lock_contended=CONTENDED,
)
signals.lock_acquired.connect(_note_acquired, weak=False)
task_retry.connect(_note_retry, weak=False)
task_postrun.connect(_note_end, weak=False)
