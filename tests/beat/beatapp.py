"""The Celery app every beat test process runs (``celery -A tests.beat.beatapp``).

Configured from the environment by the fixtures in ``conftest.py``:

- ``BEAT_TEST_BROKER``: the broker (a RedisServer of its own, never a lock master);
  results go to db 1 of the same server, records to db 2.
- ``BEAT_TEST_MASTERS``: the lock masters, comma-separated.
- ``BEAT_TEST_SCHEDULE``: JSON ``{name: {"task": ..., "every": seconds, "args": [...]}}``; an
  entry with ``"crontab": {field: value}`` instead of ``"every"`` runs on that crontab.
- ``BEAT_TEST_CONF``: JSON of extra settings (``redlock_beat_*``, ``beat_scheduler``).
- ``BEAT_TEST_RECORD``: set in beat processes; each message they publish is recorded in
  ``<key>:sent`` (key = the task's first argument) with the publishing pid and time as the
  publish begins, and in ``<key>:published`` once it reached the broker.

Workers record each run of a task body in ``<key>:runs`` (``stamped`` with the slot stamp the
message carried) and each finished message (run or skipped) in ``<key>:done``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.schedules import crontab
from celery.signals import after_task_publish, before_task_publish, task_postrun

from celery_redlock.celery.slots import SLOT_HEADER
from celery_redlock.celery.task import RedlockTask, is_skipped

BROKER = os.environ.get("BEAT_TEST_BROKER", "redis://127.0.0.1:1/0")
_base = BROKER.rsplit("/", 1)[0]


def _schedule(spec: dict[str, Any]) -> Any:
    return crontab(**spec["crontab"]) if "crontab" in spec else float(spec["every"])


app = Celery("beattests")
app.conf.update(
    broker_url=BROKER,
    result_backend=f"{_base}/1",
    redlock_masters=os.environ.get("BEAT_TEST_MASTERS", ""),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    beat_schedule={
        name: {"task": spec["task"], "schedule": _schedule(spec), "args": spec.get("args", [])}
        for name, spec in json.loads(os.environ.get("BEAT_TEST_SCHEDULE", "{}")).items()
    },
)
app.conf.update(json.loads(os.environ.get("BEAT_TEST_CONF", "{}")))

_client: tuple[int, redis.Redis] | None = None


def records() -> redis.Redis:
    """This process's client for the records db (made again after a fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(f"{_base}/2", socket_timeout=5))
    return _client[1]


def _push(key: str, **fields: Any) -> None:
    records().rpush(key, json.dumps({"pid": os.getpid(), **fields}))


@app.task(bind=True)
def record(self: Any, key: str) -> None:
    _push(f"{key}:runs", id=self.request.id, t=time.time())


@app.task(bind=True)
def stamped(self: Any, key: str) -> None:
    """Records each run with the slot stamp its message carried: runs of one tick share it."""
    stamp = getattr(self.request, SLOT_HEADER, None) or (self.request.headers or {}).get(SLOT_HEADER)
    _push(f"{key}:runs", id=self.request.id, stamp=stamp, t=time.time())


@app.task(bind=True, base=RedlockTask, lock_contended="skip", lock_ttl=2.0)
def long_job(self: Any, key: str, seconds: float) -> None:
    """A periodic job that runs for several of its periods; one run at a time, fleet-wide."""
    start = time.time()
    time.sleep(seconds)
    _push(f"{key}:runs", id=self.request.id, start=start, end=time.time())


@app.task(
    bind=True, base=RedlockTask, lock_slot=1.0, lock_release="on_expiry", lock_contended="skip", lock_ttl=4.0
)
def slot_job(self: Any, key: str) -> None:
    """Once per one-second slot, whoever sends it and however often."""
    _push(f"{key}:runs", id=self.request.id, lock=self.redlock.name, t=time.time())


if os.environ.get("BEAT_TEST_RECORD"):

    @before_task_publish.connect(weak=False)
    def _note_sent(sender: str | None = None, body: Any = None, headers: Any = None, **_: Any) -> None:
        args = body[0] if isinstance(body, tuple) and body else []
        if args:
            headers = headers or {}
            _push(
                f"{args[0]}:sent",
                id=headers.get("id"),
                task=sender,
                t=time.time(),
                slot=headers.get("redlock_slot"),
            )

    @after_task_publish.connect(weak=False)
    def _note_published(body: Any = None, headers: Any = None, **_: Any) -> None:
        # Apart from the send above: a beat stopped by SIGTERM (a warm shutdown raises
        # SystemExit wherever its main thread is) may have recorded a send it never published.
        args = body[0] if isinstance(body, tuple) and body else []
        if args:
            _push(f"{args[0]}:published", id=(headers or {}).get("id"))


@task_postrun.connect(weak=False)
def _note_done(
    task_id: str | None = None, args: Any = None, state: str | None = None, retval: Any = None, **_: Any
) -> None:
    # A retry is not an ending: the message runs again (a lock round that missed its quorum
    # because a master answered late is retried, by the no-lost-work rule), and only how that
    # copy ends is recorded.
    if args and state != "RETRY":
        _push(f"{args[0]}:done", id=task_id, state=state, skipped=is_skipped(retval))
