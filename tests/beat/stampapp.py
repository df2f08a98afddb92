"""The Celery app of the slot-stamp tests (``celery -A tests.beat.stampapp``), configured from the
environment by ``test_slot_stamp.py``:

- ``BEAT_TEST_BROKER`` / ``BEAT_TEST_MASTERS``: as for ``beatapp``; records go to db 2.
- ``STAMP_TEST_EVERY``: the period (seconds) of the one beat entry, ``job``, whose first
  argument is the record key ``STAMP_TEST_KEY``; ``STAMP_TEST_CONF``: JSON of extra settings.

Beat processes record each message they publish (``<key>:sent``: id, slot stamp, time); the
worker records each run of ``slotted`` (``<key>:runs``: id, lock name, stamp) and each finished
message (``<key>:done``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import before_task_publish, task_postrun

from celery_redlock.celery.slots import SLOT_HEADER
from celery_redlock.celery.task import RedlockTask, is_skipped

BROKER = os.environ.get("BEAT_TEST_BROKER", "redis://127.0.0.1:1/0")
_base = BROKER.rsplit("/", 1)[0]
# The period of every slot in these tests; ``slotted`` places unstamped messages by it.
PERIOD = float(os.environ.get("STAMP_TEST_EVERY", "4"))
QUEUE = "stamptests"

app = Celery("stamptests")
app.conf.update(
    broker_url=BROKER,
    result_backend=f"{_base}/1",
    redlock_masters=os.environ.get("BEAT_TEST_MASTERS", ""),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # A queue of its own: the beat tests' session worker (beatapp) consumes the default one.
    task_default_queue=QUEUE,
    beat_schedule={}
    if not os.environ.get("STAMP_TEST_KEY")
    else {
        "job": {
            "task": "tests.beat.stampapp.slotted",
            "schedule": PERIOD,
            "args": [os.environ["STAMP_TEST_KEY"]],
        }
    },
)
app.conf.update(json.loads(os.environ.get("STAMP_TEST_CONF", "{}")))

_client: tuple[int, redis.Redis] | None = None


def records() -> redis.Redis:
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(f"{_base}/2", socket_timeout=5))
    return _client[1]


def _push(key: str, **fields: Any) -> None:
    records().rpush(key, json.dumps({"pid": os.getpid(), **fields}))


@app.task(
    bind=True,
    base=RedlockTask,
    lock_slot=PERIOD,
    lock_release="on_expiry",
    lock_contended="skip",
    lock_ttl=3 * PERIOD,
)
def slotted(self: Any, key: str) -> str:
    """Once per slot; returns (and records) the lock name, slot included."""
    name = str(self.redlock.name)
    stamp = getattr(self.request, SLOT_HEADER, None) or (self.request.headers or {}).get(SLOT_HEADER)
    _push(f"{key}:runs", id=self.request.id, lock=name, stamp=stamp)
    return name


if os.environ.get("STAMP_TEST_KEY"):

    @before_task_publish.connect(weak=False)
    def _note_sent(sender: str | None = None, body: Any = None, headers: Any = None, **_: Any) -> None:
        args = body[0] if isinstance(body, tuple) and body else []
        if args:
            headers = headers or {}
            _push(f"{args[0]}:sent", id=headers.get("id"), stamp=headers.get(SLOT_HEADER), t=time.time())


@task_postrun.connect(weak=False)
def _note_done(
    task_id: str | None = None, args: Any = None, state: str | None = None, retval: Any = None, **_: Any
) -> None:
    if args:
        _push(f"{args[0]}:done", id=task_id, state=state, skipped=is_skipped(retval))
