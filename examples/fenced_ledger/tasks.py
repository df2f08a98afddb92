"""Credit an account under a fenced lock, so that a paused worker's late write is refused.

A lock with a TTL cannot stop a holder that stops (a GC pause, a SIGSTOP, a slow disk) after it
read and before it wrote: its lock expires, the next holder reads and writes, and the first one
wakes up and overwrites that with a balance computed from what it read before. ``lock_fenced=True``
gives every run a fence, ``self.redlock.fence``, above every earlier run's; the row keeps the
highest fence it has seen (``FencedRows``) and refuses a write carrying a lower one with
``StaleFence``, which ``autoretry_for`` turns into a retry: a new run, a new fence, a fresh read.

The claim is committed on its own, before the read: it must reach the row before the balance is
read (a later holder then refuses this one's write, whatever the order of the two writes), and a
holder paused inside an open transaction would keep SQLite's write lock (PostgreSQL's row lock),
making the next holder wait for it to wake up.

``credit_unfenced`` is the same body under a plain lock, to show what the fence prevents.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any

from celery import Celery

from celery_redlock import RedlockTask, StaleFence
from celery_redlock.fenced import FencedRows

app = Celery("fenced_ledger")
app.conf.broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
app.conf.result_backend = os.environ.get("CELERY_RESULT_BACKEND", "rpc://")
app.conf.redlock_masters = os.environ.get("REDLOCK_MASTERS", "")
app.conf.broker_connection_retry_on_startup = True
app.conf.worker_prefetch_multiplier = 1

LEDGER_DB = os.environ.get("LEDGER_DB", "ledger.sqlite3")
EVENTS_FILE = os.environ.get("EVENTS_FILE", "events.jsonl")
THINK = 1.0  # seconds between the read and the write: the work a real task would do there

ROWS = FencedRows("accounts", key="name", fence="fence")
LOCK = {
    "lock_key": "account:<account>",
    "lock_ttl": 2.0,  # short, so a stopped worker's lock is free again soon
    "lock_retry_backoff": 0.2,  # a contended run tries again within a fraction of that
    "lock_retry_backoff_max": 0.5,
}


def create_ledger(path: str, *accounts: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS accounts (name TEXT PRIMARY KEY, "
            "balance BIGINT NOT NULL DEFAULT 0, fence BIGINT NOT NULL DEFAULT 0)"
        )
        conn.executemany("INSERT OR IGNORE INTO accounts (name) VALUES (?)", [(a,) for a in accounts])
    conn.close()


def record(event: str, **fields: Any) -> None:
    """One line of what happened, for run.py to watch (one short append: atomic enough)."""
    with open(EVENTS_FILE, "a") as events:
        events.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


def _credit(task: Any, account: str, amount: int) -> int:
    fence = task.redlock.fence if task.redlock.fenced else None
    conn = sqlite3.connect(LEDGER_DB, timeout=10)
    try:
        if fence is not None:
            with conn:  # committed on its own (see the module docstring)
                ROWS.claim(conn.cursor(), account, fence)  # StaleFence if a later run was here
        (balance,) = conn.execute("SELECT balance FROM accounts WHERE name = ?", (account,)).fetchone()
        record("read", account=account, amount=amount, balance=balance, fence=fence)
        time.sleep(THINK)
        new_balance = balance + amount
        with conn:
            if fence is None:
                conn.execute("UPDATE accounts SET balance = ? WHERE name = ?", (new_balance, account))
            else:
                try:
                    ROWS.update(conn.cursor(), account, fence, balance=new_balance)
                except StaleFence as refused:
                    record("refused", account=account, fence=refused.fence, current=refused.current)
                    raise
        record("wrote", account=account, amount=amount, balance=new_balance, fence=fence)
        return int(new_balance)
    finally:
        conn.close()


@app.task(
    bind=True,
    base=RedlockTask,
    lock_fenced=True,
    autoretry_for=(StaleFence,),
    retry_kwargs={"countdown": 0, "max_retries": 3},
    **LOCK,
)
def credit(self: Any, account: str, amount: int) -> int:
    return _credit(self, account, amount)


@app.task(bind=True, base=RedlockTask, lock_fenced=False, **LOCK)
def credit_unfenced(self: Any, account: str, amount: int) -> int:
    return _credit(self, account, amount)
