"""Duplicate prevention across a worker fleet: an invoice is charged once, however often it is sent.

Double clicks, client retries and broker redeliveries all send ``charge_invoice(42)`` more than
once, and two workers may pick the copies up at the same moment. The body is idempotent (it
checks whether the invoice is already paid), but a check-then-act is only safe if no other
process runs it for the same invoice at the same time: that is what the lock guarantees.

Configuration comes from the environment, so the same file runs on a laptop and in
docker-compose: ``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND``, ``REDLOCK_MASTERS``
(comma-separated redis URLs of independent masters) and ``INVOICES_DB`` (an SQLite file every
worker can reach).
"""

from __future__ import annotations

import os
import sqlite3
import time

from celery import Celery

from celery_redlock import RedlockTask

app = Celery("invoices")
app.conf.broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
app.conf.result_backend = os.environ.get("CELERY_RESULT_BACKEND", "rpc://")
app.conf.redlock_masters = os.environ.get("REDLOCK_MASTERS", "")  # "redis://m1:6379,redis://m2:6379,..."
app.conf.redlock_ttl = 30  # seconds; the heartbeat extends it while a charge runs longer
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True
app.conf.beat_schedule = {
    "retry-failed-charges": {"task": "tasks.retry_failed_charges", "schedule": 60.0},
}

DB = os.environ.get("INVOICES_DB", "invoices.sqlite3")


def db() -> sqlite3.Connection:
    conn = sqlite3.connect(DB, timeout=30, isolation_level=None)
    conn.execute("CREATE TABLE IF NOT EXISTS invoices (id INTEGER PRIMARY KEY, status TEXT)")
    conn.execute("CREATE TABLE IF NOT EXISTS charges (invoice_id INTEGER, worker_pid INTEGER)")
    return conn


def is_paid(invoice_id: int) -> bool:
    with db() as conn:
        row = conn.execute("SELECT status FROM invoices WHERE id = ?", (invoice_id,)).fetchone()
    return row is not None and row[0] == "paid"


def charge(invoice_id: int) -> None:
    time.sleep(0.05)  # the payment provider's round trip: a second charge would go through
    with db() as conn:
        conn.execute("INSERT INTO charges VALUES (?, ?)", (invoice_id, os.getpid()))
        conn.execute("INSERT OR REPLACE INTO invoices VALUES (?, 'paid')", (invoice_id,))


# bind=True makes the task's first argument `self`, the task, so the body can reach its lock.
@app.task(bind=True, base=RedlockTask, lock_key="invoice:<invoice_id>", lock_contended="retry")
def charge_invoice(self: RedlockTask, invoice_id: int) -> str:
    if is_paid(invoice_id):
        return "already paid"
    self.redlock.ensure()  # raises LockLost if the lock is no longer held: never charge then
    charge(invoice_id)
    return "charged"


@app.task(base=RedlockTask, lock_contended="skip")
def retry_failed_charges() -> int:
    """Periodic: with no lock_key, the task's own name is the resource, so runs never overlap."""
    with db() as conn:
        return int(conn.execute("SELECT count(*) FROM invoices WHERE status != 'paid'").fetchone()[0])
