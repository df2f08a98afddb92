"""The app of tests/celery/test_celery_fork_threads.py: a prefork worker that records, in the
process that forks, which threads are alive at each ``fork``.

``os.register_at_fork(before=...)`` runs in the forking process just before each ``fork``: the
worker's main process before it forks each pool child (at start, and again for every child it
replaces: ``worker_max_tasks_per_child=1`` makes it replace one after each task). Each fork
appends one JSON line to ``FORKAPP_RECORD``: the pid and every live thread's name.

Configured from the environment: ``FORKAPP_BROKER``, ``FORKAPP_MASTERS`` (comma-separated),
``FORKAPP_RECORD`` (a file path), ``FORKAPP_METRICS`` (a ``redlock_metrics`` port, or empty).
"""

from __future__ import annotations

import json
import os
import threading
import time

from celery import Celery

from celery_redlock import RedlockTask

RECORD = os.environ.get("FORKAPP_RECORD", "")


def _record_threads_before_fork() -> None:
    if not RECORD:
        return
    line = json.dumps({"pid": os.getpid(), "threads": [t.name for t in threading.enumerate()]})
    fd = os.open(RECORD, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


os.register_at_fork(before=_record_threads_before_fork)

BROKER = os.environ.get("FORKAPP_BROKER", "redis://127.0.0.1:1/0")
app = Celery("forkthreadsapp", broker=BROKER, backend=BROKER)
app.conf.update(
    redlock_masters=os.environ.get("FORKAPP_MASTERS") or None,
    redlock_ttl=5.0,
    redlock_metrics=int(os.environ["FORKAPP_METRICS"]) if os.environ.get("FORKAPP_METRICS") else False,
    worker_prefetch_multiplier=1,
    worker_max_tasks_per_child=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("FORKAPP_QUEUE", "forkthreadsapp"),
)


@app.task(bind=True, base=RedlockTask, lock_key="fork:<key>", name="forkthreadsapp.hold")
def hold(self: RedlockTask, key: str, seconds: float) -> int:
    """Hold ``key`` for ``seconds`` (long enough for a heartbeat to beat); the child's pid."""
    time.sleep(seconds)
    return os.getpid()
