"""A worker paused between its read and its write, with and without fencing, on real processes.

    python examples/fenced_ledger/run.py

Starts five embedded masters, an embedded broker and one prefork worker with two pool children
(needs celery-redlock[embedded]), and stops them all on the way out. For each story: credit
+100, SIGSTOP the pool child that read the balance, credit +50 (the other child runs it once the
stopped child's lock has expired), SIGCONT. Exits 0 iff the unfenced ledger lost the +50 and the
fenced one refused the late write and ended at 150.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from celery_redlock.testing.servers import process_state

HERE = Path(__file__).resolve().parent


def events(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line]


def wait_for(path: Path, what: Callable[[dict[str, Any]], bool], timeout: float, name: str) -> dict[str, Any]:
    """The first event ``what`` accepts, polled for until ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events(path):
            if what(event):
                return event
        time.sleep(0.02)
    raise TimeoutError(f"no {name} within {timeout}s")


def balance(db: Path, account: str) -> int:
    with sqlite3.connect(db) as conn:
        (found,) = conn.execute("SELECT balance FROM accounts WHERE name = ?", (account,)).fetchone()
    conn.close()
    return int(found)


def story(task: Any, account: str, db: Path, log: Path) -> list[dict[str, Any]]:
    """+100 stopped after its read, +50 meanwhile, then the stopped one resumed; its events."""
    first = task.delay(account, 100)
    read = wait_for(log, lambda e: e["event"] == "read" and e["account"] == account, 30, "read of +100")
    stopped = int(read["pid"])
    os.kill(stopped, signal.SIGSTOP)
    try:
        second = task.delay(account, 50)
        wait_for(
            log,
            lambda e: e["event"] == "wrote" and e["account"] == account and e["amount"] == 50,
            30,
            "write of +50",
        )
    finally:
        os.kill(stopped, signal.SIGCONT)
    first.get(timeout=30)
    second.get(timeout=30)
    assert process_state(stopped) not in ("T", "t")
    return [e for e in events(log) if e["account"] == account]


def main() -> int:
    with ServerSet(5) as masters, RedisServer() as broker, tempfile.TemporaryDirectory() as tmp:
        db, log = Path(tmp) / "ledger.sqlite3", Path(tmp) / "events.jsonl"
        env = {
            "CELERY_BROKER_URL": broker.url,
            "CELERY_RESULT_BACKEND": broker.url,
            "REDLOCK_MASTERS": ",".join(masters.urls),
            "LEDGER_DB": str(db),
            "EVENTS_FILE": str(log),
        }
        os.environ.update(env)
        sys.path.insert(0, str(HERE))
        import tasks

        tasks.create_ledger(str(db), "alice", "bob")
        # -O fair: a message goes only to an idle pool child, never queued behind the stopped one.
        with CeleryWorker("tasks", concurrency=2, args=["-O", "fair"], env=env, cwd=HERE, pythonpath=[HERE]):
            story(tasks.credit_unfenced, "alice", db, log)
            unfenced = balance(db, "alice")
            lost = "a credit was lost" if unfenced < 150 else "nothing was lost this time"
            print(f"unfenced: balance {unfenced}, expected 150 ({lost})")

            fenced_events = story(tasks.credit, "bob", db, log)
            fenced = balance(db, "bob")
            refused = [e for e in fenced_events if e["event"] == "refused"]
            if refused:
                print(
                    f"fenced: balance {fenced}; stale write refused "
                    f"(fence {refused[0]['fence']} < {refused[0]['current']}), retried"
                )
            else:
                print(f"fenced: balance {fenced}; no write was refused", file=sys.stderr)
        return 0 if unfenced == 100 and fenced == 150 and len(refused) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
