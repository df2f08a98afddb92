"""A periodic job that never overlaps, scheduled by two beats in HA.

Two defences, for two different failures:

- ``RedlockScheduler``: run ``celery beat`` on two hosts; only the one holding the beat leader
  lock sends, and if it dies the other takes over within the lock's TTL (3 s here).
- ``RedlockTask`` with ``lock_contended="skip"``: a run that is still going when the next slot
  comes (the job takes 1.5 s, the schedule fires every second) makes the next one skip, with a
  log line and the ``lock_contended`` signal, instead of running two at once.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from celery_redlock import RedlockTask

app = Celery("beat_singleton")
app.conf.broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
app.conf.redlock_masters = os.environ.get("REDLOCK_MASTERS", "")
app.conf.broker_connection_retry_on_startup = True
app.conf.beat_scheduler = "celery_redlock.beat:RedlockScheduler"
app.conf.redlock_beat_lock_name = "beat:beat_singleton"
app.conf.redlock_beat_lock_ttl = 3.0
app.conf.redlock_beat_standby_interval = 0.5
app.conf.beat_schedule = {
    "rebuild-search-index": {"task": "tasks.rebuild_search_index", "schedule": 1.0},
}

RUNS = os.environ.get("RUNS_FILE", "runs.jsonl")


@app.task(base=RedlockTask, lock_contended="skip", lock_ttl=10.0, ignore_result=True)
def rebuild_search_index() -> None:
    start = time.time()
    time.sleep(1.5)  # longer than the schedule's period, on purpose
    with open(RUNS, "a") as runs:
        runs.write(json.dumps({"start": start, "end": time.time(), "pid": os.getpid()}) + "\n")
