"""The Celery app the demo's workers run: ``charge_invoice``, which charges each invoice once.

Three features of the package together, as a shop would use them for "charge an invoice once":

- a Redlock per invoice (``lock_key="invoice:<invoice_id>"``): no two bodies of one invoice run
  at once, on any worker;
- deduplication at enqueue (``lock_enqueue="return_existing"``): a call made while the same
  invoice's charge is queued or running publishes nothing and is handed that task's id;
- an idempotency check in the body, under the lock (:class:`.ledger.Charges`): a call that runs
  after the invoice was charged finds it charged and does nothing.

A call published by name (``app.send_task``, as a service without the task class does) is not
deduplicated at enqueue; while another call of its invoice holds the lock it is skipped
(``lock_contended="skip"``, naming the holder) or waits its turn (``"retry"``).

Shipped inside the package so that ``celery -A celery_redlock.demo.tasks worker`` works from any
directory. Configured from the environment the demo gives its workers:

- ``CELERY_REDLOCK_DEMO_BROKER``: the broker URL;
- ``CELERY_REDLOCK_DEMO_MASTERS``: the lock masters, comma-separated redis URLs;
- ``CELERY_REDLOCK_DEMO_LEDGER``: the directory each process writes what it saw to (and the
  charges are recorded in);
- ``CELERY_REDLOCK_DEMO_WORK``: how long one charge takes, in seconds;
- ``CELERY_REDLOCK_DEMO_CONTENDED``: what a duplicate does while the invoice is locked
  (``skip``: give up, naming the holder; ``retry``: wait its turn).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from celery import Celery, Task
from celery.signals import task_postrun, task_retry

from ..celery import signals
from ..celery.task import RedlockTask, is_skipped
from ..errors import LockNotAcquired
from .ledger import ALREADY, CHARGED, Charges, LedgerWriter

ENV_BROKER = "CELERY_REDLOCK_DEMO_BROKER"
ENV_MASTERS = "CELERY_REDLOCK_DEMO_MASTERS"
ENV_LEDGER = "CELERY_REDLOCK_DEMO_LEDGER"
ENV_WORK = "CELERY_REDLOCK_DEMO_WORK"
ENV_CONTENDED = "CELERY_REDLOCK_DEMO_CONTENDED"

TASK_NAME = "celery_redlock.demo.charge_invoice"
LOCK_TTL = 5.0

WORK = float(os.environ.get(ENV_WORK, "0.05"))
CONTENDED = os.environ.get(ENV_CONTENDED, "skip")

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
_charges = Charges(os.environ.get(ENV_LEDGER, "."))
# How long each execution's lock acquisition took, from the lock_acquired signal to its body.
_acquired: dict[str, float] = {}
_started_lock = threading.Lock()


def _charge_invoice(self: Task, invoice_id: int) -> dict[str, Any]:
    """Charge one invoice unless it was charged: a check-then-charge, safe only under the lock."""
    start = time.monotonic()
    with _started_lock:
        acquire = _acquired.pop(self.request.id, 0.0)
    charged_by = _charges.charged_by(invoice_id)
    outcome = ALREADY
    if charged_by is None:
        time.sleep(WORK)  # the payment provider's round trip
        self.redlock.ensure()  # LockLost here means the charge must not be recorded
        charged_by = self.request.id
        _charges.record(invoice_id, charged_by)
        outcome = CHARGED
    _ledger.write(
        "run",
        task_id=self.request.id,
        resource=f"invoice:{invoice_id}",
        start=start,
        end=time.monotonic(),
        acquire=acquire,
        outcome=outcome,
        charged_by=charged_by,
    )
    return {"invoice": invoice_id, "outcome": outcome, "charged_by": charged_by}


def _note_acquired(sender: Any = None, task_id: str | None = None, elapsed: float = 0.0, **_: Any) -> None:
    if getattr(sender, "name", None) == TASK_NAME and task_id is not None:
        with _started_lock:
            _acquired[task_id] = elapsed


def _note_retry(request: Any = None, reason: Any = None, **_: Any) -> None:
    if request is not None and getattr(request, "task", None) == TASK_NAME:
        # Why: the lock was held (under "skip" too, when its holder let go before it could be
        # named: there was no one to skip for), or no quorum of masters answered.
        error = getattr(reason, "exc", None)
        unavailable = isinstance(error, LockNotAcquired) and not error.contended
        _ledger.write("retry", task_id=request.id, unavailable=unavailable)


def _note_end(
    task_id: str | None = None, task: Any = None, state: str | None = None, retval: Any = None, **_: Any
) -> None:
    if getattr(task, "name", None) == TASK_NAME and task_id is not None:
        with _started_lock:
            _acquired.pop(task_id, None)
        # A skipped run's value names the holder it was skipped for, and why.
        skip = {"holder": retval.get("holder"), "reason": retval.get("reason")} if is_skipped(retval) else {}
        _ledger.write("done", task_id=task_id, state=state or "", **skip)


# Applied as calls rather than decorators: Celery is untyped, and a decorator would erase the types.
charge_invoice = app.task(
    _charge_invoice,
    base=RedlockTask,
    bind=True,
    name=TASK_NAME,
    lock_key="invoice:<invoice_id>",
    lock_ttl=LOCK_TTL,
    lock_contended=CONTENDED,
    lock_enqueue="return_existing",
)
signals.lock_acquired.connect(_note_acquired, weak=False)
task_retry.connect(_note_retry, weak=False)
task_postrun.connect(_note_end, weak=False)
