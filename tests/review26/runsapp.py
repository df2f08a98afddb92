"""The Celery app of the issue 26 RunState review (``celery -A runsapp worker``), configured from
the environment: ``RUNSAPP_BROKER`` (broker, result backend and the records store, one Redis URL)
and ``RUNSAPP_MASTERS`` (comma-separated lock master URLs). The same tasks run eagerly in the test
process (``apply()``) and in a real worker.

Every run's ``lock_released`` signal and what each body saw are pushed, as JSON, on Redis lists
named after the test's tag, so the test reads what happened in the worker.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery

from celery_redlock import RedlockTask
from celery_redlock.celery import signals as lock_signals
from celery_redlock.lock.owner import current_owner

BROKER = os.environ.get("RUNSAPP_BROKER", "redis://127.0.0.1:1/0")

app = Celery("runsapp", broker=BROKER, backend=BROKER, set_as_current=False)
app.conf.update(
    redlock_masters=os.environ.get("RUNSAPP_MASTERS") or None,
    redlock_ttl=10.0,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("RUNSAPP_QUEUE", "runsapp"),
)

_stores: dict[int, redis.Redis] = {}


def store() -> redis.Redis:
    pid = os.getpid()
    if pid not in _stores:
        _stores[pid] = redis.Redis.from_url(app.conf.broker_url, socket_timeout=5)
    return _stores[pid]


def push(tag: str, what: str, **fields: Any) -> None:
    store().rpush(f"runs26:{tag}:{what}", json.dumps(fields))


def read(tag: str, what: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in store().lrange(f"runs26:{tag}:{what}", 0, -1)]


@lock_signals.lock_released.connect
def _released(sender: Any = None, key: str = "", task_id: str = "", state: str = "", **_: Any) -> None:
    tag = key.rpartition(":")[2] if key.startswith("runs26:") else ""
    if tag:
        push(tag.split("/")[0], "released", task_id=task_id, key=key, state=state)


@app.task(bind=True, base=RedlockTask, lock_key="runs26:<tag>/<n>", name="runs26.ends", max_retries=1)
def ends(self: Any, tag: str, n: int, how: str = "ok") -> str:
    """Ends as ``how`` says: ``ok``, ``raise``, ``retry`` (once, then ok) or ``self`` (calls
    itself directly from its body first)."""
    if how == "raise":
        raise ValueError("ended by raising")
    if how == "retry" and self.request.retries == 0:
        raise self.retry(countdown=0.1)
    if how == "self":
        ends(tag, n + 1000, "ok")  # a direct call: the plain function, no run of its own
        self.redlock.ensure()  # and this run still holds its lock
    return how


@app.task(base=RedlockTask, lock_key="runs26:<tag>/owner", lock_reentrant=True, name="runs26.reentrant")
def reentrant(tag: str) -> str:
    owner = current_owner()
    push(tag, "owner", task="reentrant", owner=owner)
    return owner


@app.task(name="runs26.plain")
def plain(tag: str) -> str:
    """Not locked: what it sees is what the thread is, with no run's scope around it."""
    owner = current_owner()
    push(tag, "owner", task="plain", owner=owner)
    return owner
