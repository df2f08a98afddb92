"""The Celery app of the golden outcome matrix (``celery -A tests.golden_celery.pathsapp worker``).

Configured from the environment in the workers (``GOLDEN_BROKER``: broker and result backend,
``GOLDEN_RECORDS``: the Redis the tasks and hooks write their records to, ``GOLDEN_MASTERS``:
comma-separated lock master URLs), and by :func:`configure` in the test process, which runs the
eager paths and reads the records.

Every task takes the case's ``tag`` as its first argument (``collect`` as the keyword ``tag``)
and locks ``golden:<tag>`` unless said otherwise, so no two cases share a key or a record list.
What is recorded, each on a Redis list of its own:

- ``golden:runs:<tag>``: one entry per body run, saying whether the body held its lock;
- ``golden:post:<tag>``: one entry per ``task_postrun`` (the tracer's view of how a run ended);
- ``golden:sig:<lock name>``: the lock signals (acquired, contended or unavailable with its
  policy, released with the run's state, lost, deduplicated at publish), in the order they were
  sent.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject

from celery_redlock import NotLocked, RedlockTask, app_redlock
from celery_redlock.celery import signals as lock_signals

UNROUTED = "golden-unrouted"  # a publish that forgot its queue lands here, where nobody consumes
RECORDS = os.environ.get("GOLDEN_RECORDS", "redis://127.0.0.1:1/1")

app = Celery("golden", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("GOLDEN_BROKER", "redis://127.0.0.1:1/0"),
    result_backend=os.environ.get("GOLDEN_BROKER", "redis://127.0.0.1:1/0"),
    redlock_masters=os.environ.get("GOLDEN_MASTERS") or None,
    redlock_ttl=5.0,
    # The matrix is about paths, not timeouts: a round on a loaded host must not miss its quorum
    # for replies later than the default 0.1 s (that is unavailability, retried, a path of its
    # own: recorded as "unavailable:retry"). 0.5 s keeps golden.expires's 2 s TTL above its floor.
    redlock_request_timeout=0.5,
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.2,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=UNROUTED,
)

_store: redis.Redis | None = None
_store_pid = 0


def configure(broker: str, records: str, masters: list[str]) -> None:
    """The test process's side: the same app as the workers'."""
    global RECORDS, _store
    RECORDS, _store = records, None
    app.conf.update(broker_url=broker, result_backend=broker, redlock_masters=masters)


def store() -> redis.Redis:
    """A client for the records, one per process (a prefork child makes its own)."""
    global _store, _store_pid
    if _store is None or _store_pid != os.getpid():
        _store = redis.Redis.from_url(RECORDS, socket_timeout=5)
        _store_pid = os.getpid()
    return _store


def runs_list(tag: str) -> str:
    return f"golden:runs:{tag}"


def postrun_list(tag: str) -> str:
    return f"golden:post:{tag}"


def signal_list(key: str) -> str:
    return f"golden:sig:{key}"


def ran(task: Any, tag: str, **fields: Any) -> None:
    """Record one run of a body, and whether it held its lock there."""
    try:
        owned = bool(task.redlock.owned())
    except NotLocked:
        owned = False
    store().rpush(runs_list(tag), json.dumps({"owned": owned, **fields}))


# -- the tasks ----------------------------------------------------------------------------------------
LOCKED = {"bind": True, "base": RedlockTask, "shared": False}


@app.task(**LOCKED, lock_key="golden:<tag>", name="golden.succeeds")
def succeeds(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ok"


@app.task(**LOCKED, lock_key="golden:<tag>", name="golden.raises")
def raises(self: RedlockTask, tag: str) -> None:
    ran(self, tag)
    raise ValueError("the body failed")


@app.task(**LOCKED, lock_key="golden:<tag>", max_retries=1, name="golden.retries_once")
def retries_once(self: RedlockTask, tag: str) -> int:
    """``self.retry()`` once, then succeeds. The countdown keeps the retried copy well behind
    this run's release, so it never meets this run's lock (that path is the earlier-attempt one)."""
    ran(self, tag)
    if self.request.retries == 0:
        raise self.retry(countdown=0.5)
    return int(self.request.retries)


@app.task(**LOCKED, lock_key="golden:<tag>", name="golden.ignores")
def ignores(self: RedlockTask, tag: str) -> None:
    ran(self, tag)
    raise Ignore()


@app.task(**LOCKED, lock_key="golden:<tag>", acks_late=True, name="golden.rejects")
def rejects(self: RedlockTask, tag: str) -> None:
    """Reject acts on the message only when it is acknowledged late (Celery's docs)."""
    ran(self, tag)
    raise Reject("given up", requeue=False)


@app.task(**LOCKED, lock_key="golden:<tag>", lock_contended="skip", name="golden.skips")
def skips(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ran"


@app.task(**LOCKED, lock_key="golden:<tag>", lock_contended="fail", name="golden.fails")
def fails(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ran"


@app.task(
    **LOCKED,
    lock_key="golden:<tag>",
    lock_contended="retry",
    lock_max_retries=30,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.2,
    name="golden.retries",
)
def retries(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ran"


@app.task(
    **LOCKED,
    lock_key="golden:<tag>",
    lock_contended="retry",
    lock_max_retries=2,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.1,
    name="golden.exhausts",
)
def exhausts(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ran"


@app.task(
    **LOCKED,
    lock_key="golden:<tag>",
    lock_contended="wait",
    lock_wait_timeout=15.0,
    lock_max_retries=0,  # a wait that is not woken fails at once: the matrix would show it
    name="golden.waits",
)
def waits(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ran"


@app.task(**LOCKED, lock_key=None, lock_contended="skip", name="golden.task_wide")
def task_wide(self: RedlockTask, tag: str) -> str:
    """``lock_key=None``: one lock for every call of the task, ``%task:golden.task_wide``."""
    ran(self, tag)
    return "ran"


@app.task(**LOCKED, lock_key="golden:<tag>", lock_contended="skip", name="golden.link")
def link(self: RedlockTask, tag: str, n: int) -> int:
    """A chain link: every link locks the same key, and a link that found the previous one's
    lock would be skipped."""
    ran(self, tag, n=n)
    return n


@app.task(name="golden.collect", shared=False)
def collect(value: Any, tag: str = "") -> Any:
    """A plain (unlocked) chain link: returns what it was given."""
    return value


@app.task(**LOCKED, lock_key="golden:<tag>", max_retries=0, name="golden.fallback")
def fallback(self: RedlockTask, tag: str) -> str:
    """Celery refuses the retry (max_retries=0); the fallback runs, still under the lock."""
    try:
        self.retry(countdown=0)
    except MaxRetriesExceededError:
        ran(self, tag, fallback=True)
    return "fallback"


@app.task(**LOCKED, lock_key="golden:<tag>", max_retries=1, name="golden.no_throw")
def no_throw(self: RedlockTask, tag: str) -> int:
    """``retry(throw=False)`` returns into the body, which goes on under the lock and returns;
    the retried copy then runs once more."""
    if self.request.retries == 0:
        self.retry(countdown=0.5, throw=False)
    ran(self, tag, retries=self.request.retries)
    return int(self.request.retries)


@app.task(**LOCKED, lock_key="golden:<tag>", lock_release="on_expiry", lock_ttl=2.0, name="golden.expires")
def expires(self: RedlockTask, tag: str) -> str:
    ran(self, tag)
    return "ran"


@app.task(**LOCKED, lock_key="golden:<tag>", lock_reentrant=True, name="golden.reentrant")
def reentrant(self: RedlockTask, tag: str) -> int:
    """Code the body calls takes the task's own lock again, through the app's Redlock."""
    with app_redlock(app).lock(f"golden:{tag}", ttl=5, reentrant=True) as inner:
        depth = int(inner.depth)
    ran(self, tag, depth=depth)
    return depth


@app.task(**LOCKED, lock_key="golden:<tag>", lock_enqueue="return_existing", name="golden.enqueued")
def enqueued(self: RedlockTask, tag: str, flag: str, limit: float) -> str:
    """Runs until the test sets ``flag`` in the records (an event, not a duration), at most
    ``limit`` seconds."""
    ran(self, tag)
    deadline = time.monotonic() + limit
    while not store().exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "ran"


# -- what the runs report ---------------------------------------------------------------------------
def _signal(key: str, event: str) -> None:
    store().rpush(signal_list(key), event)


@lock_signals.lock_acquired.connect
def _on_acquired(sender: Any = None, key: str = "", **_: Any) -> None:
    _signal(key, "acquired")


@lock_signals.lock_contended.connect
def _on_contended(sender: Any = None, key: str = "", policy: str = "", error: Any = None, **_: Any) -> None:
    # A round that missed its quorum because masters did not answer in time (a loaded host) is
    # unavailability, not contention: recorded apart, so the matrix can tell the two.
    kind = "contended" if error is None or error.contended else "unavailable"
    _signal(key, f"{kind}:{policy}")


@lock_signals.lock_released.connect
def _on_released(sender: Any = None, key: str = "", state: str = "", expire: bool = False, **_: Any) -> None:
    _signal(key, f"released:{state}" + (":expire" if expire else ""))


@lock_signals.lock_lost.connect
def _on_lost(sender: Any = None, key: str = "", **_: Any) -> None:
    _signal(key, "lost")


@lock_signals.enqueue_deduplicated.connect
def _on_deduplicated(sender: Any = None, key: str = "", mode: str = "", **_: Any) -> None:
    _signal(key, f"deduplicated:{mode}")


@celery_signals.task_postrun.connect
def _on_postrun(
    sender: Any = None,
    task_id: str = "",
    task: Any = None,
    args: Any = None,
    kwargs: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    name = getattr(task, "name", "") or ""
    if not name.startswith("golden."):
        return
    tag = (kwargs or {}).get("tag")
    if not isinstance(tag, str) and args and isinstance(args[0], str):
        tag = args[0]
    if isinstance(tag, str) and tag:
        record = {"task": name.removeprefix("golden."), "id": task_id, "state": state}
        store().rpush(postrun_list(tag), json.dumps(record))
