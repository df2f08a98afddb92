"""The Celery app of the adversarial review's real workers (``celery -A tests.review.reviewapp``).

Configured from the environment so the workers and the test process build the same app:
``REVIEW_BROKER``, ``REVIEW_BACKEND`` (result backend), ``REVIEW_RECORDS`` (the Redis the bodies
write what they saw to) and ``REVIEW_MASTERS`` (comma-separated lock masters).

Every task locks ``r:<key>``; what happens to a key is appended, one JSON object per event, to
the Redis list ``rec:<key>``: ``start``/``end`` from the bodies, ``refused`` from a
``lock_contended`` receiver (with the policy decided), ``released`` from ``lock_released``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from celery import signals as celery_signals
from celery.exceptions import Reject

from celery_redlock import RedlockTask
from celery_redlock.celery import signals as lock_signals

from ..waiting import wait_for as wait_for  # the review tests import it from here
from ..workerapp import Records, worker_app

app = worker_app(
    "review", "REVIEW", redlock_ttl=20.0, redlock_retry_backoff=0.05, redlock_retry_backoff_max=0.3
)
records = Records("REVIEW_RECORDS")


def record(key: str, event: str, **fields: Any) -> None:
    key = key.removeprefix("r:")
    fields.setdefault("t", time.time())
    records().rpush(f"rec:{key}", json.dumps({"event": event, "key": key, "pid": os.getpid(), **fields}))


def events(key: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in records().lrange(f"rec:{key}", 0, -1)]


@app.task(bind=True, base=RedlockTask, name="review.sleeper", lock_key="r:<key>", lock_contended="fail")
def sleeper(self: Any, key: str, seconds: float = 0.0) -> str:
    """Holds ``r:<key>`` for ``seconds`` (in short sleeps, so a time limit can end it)."""
    return _hold(self, key, seconds)


def _hold(self: Any, key: str, seconds: float) -> str:
    record(key, "start", task_id=self.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    record(key, "end", task_id=self.request.id)
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.deduped",
    lock_key="r:<key>",
    lock_contended="fail",
    lock_enqueue="return_existing",
)
def deduped(self: Any, key: str, seconds: float = 0.0) -> str:
    """``sleeper`` with enqueue dedup: a publish while one is queued or running returns that one."""
    return _hold(self, key, seconds)


@app.task(bind=True, base=RedlockTask, name="review.cruncher", lock_key="r:<key>", lock_contended="fail")
def cruncher(self: Any, key: str, iterations: int) -> str:
    """Holds ``r:<key>`` through one long computation in C (no Python signal handler runs until it
    returns: a regex gone exponential, a key derivation, a call into a native library)."""
    record(key, "start", task_id=self.request.id)
    hashlib.pbkdf2_hmac("sha256", b"review", b"salt", iterations)
    record(key, "end", task_id=self.request.id)
    return key


@app.task(
    bind=True, base=RedlockTask, name="review.summer", lock_key="r:<key>", lock_contended="fail", lock_ttl=2.0
)
def summer(self: Any, key: str, count: int) -> str:
    """One long call into C that holds the GIL throughout (``sum`` over a range; a regex gone
    exponential, a big ``sorted`` are the same): no other thread of the process runs meanwhile."""
    record(key, "start", task_id=self.request.id)
    sum(range(count))
    record(key, "end", task_id=self.request.id, owned=self.redlock.owned())
    return key


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.skipper",
    lock_key="r:<key>",
    lock_contended="skip",
    lock_ttl=5.0,
)
def skipper(self: Any, key: str) -> str:
    """A no-op step of ``r:<key>`` in skip mode."""
    record(key, "start", task_id=self.request.id)
    record(key, "end", task_id=self.request.id)
    return f"ran {key}"


@app.task(bind=True, base=RedlockTask, name="review.replacer", lock_key="r:<key>", lock_contended="skip")
def replacer(self: Any, key: str) -> Any:
    """Replaces itself with the next step of the same resource (``skipper``), then tidies up:
    its ``finally`` lasts until the replacement has asked for the lock (at most 5 s), as any
    clean-up that takes a moment would."""
    record(key, "start", task_id=self.request.id)
    try:
        queue = (self.request.delivery_info or {}).get("routing_key")
        return self.replace(skipper.si(key).set(queue=queue) if queue else skipper.si(key))
    finally:
        if not self.request.is_eager:
            me = self.request.id
            wait_for(lambda: _replacement_came(key, me), 5.0)
        record(key, "end", task_id=self.request.id)


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.autoretrier",
    lock_key="r:<key>",
    lock_contended="skip",
    autoretry_for=(ValueError,),
    retry_kwargs={"max_retries": 3, "countdown": 0},
)
def autoretrier(self: Any, key: str) -> int:
    """Fails its first two tries with ValueError (``autoretry_for``, countdown 0): each retried
    copy is published while this run still holds the lock."""
    tries = int(records().incr(f"tries:{key}"))
    record(key, "start", task_id=self.request.id, tries=tries)
    if tries <= 2:
        raise ValueError(f"try {tries}")
    return tries


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.retrier",
    lock_key="r:<key>",
    lock_contended="fail",
    lock_max_retries=0,
)
def retrier(self: Any, key: str) -> int:
    """Retries itself once (countdown 0, no lock retry budget), holding the lock until the retried
    copy has been refused it (at most 5 s)."""
    tries = int(records().incr(f"tries:{key}"))
    record(key, "start", task_id=self.request.id, tries=tries)
    if tries == 1:
        try:
            raise self.retry(countdown=0)
        finally:
            me = self.request.id
            wait_for(lambda: _replacement_came(key, me), 5.0)
    return tries


@app.task(bind=True, base=RedlockTask, name="review.loser", lock_key="r:<key>", lock_contended="fail")
def loser(self: Any, key: str) -> bool:
    """Holds ``r:<key>`` until the test says go (at most 20 s); whether it still owned it then."""
    record(key, "start", task_id=self.request.id)
    wait_for(lambda: records().exists(f"go:{key}"), 20.0)
    owned = self.redlock.owned()
    record(key, "end", task_id=self.request.id, owned=owned)
    return bool(owned)


@app.task(bind=True, base=RedlockTask, name="review.failer", lock_key="r:<key>", lock_contended="skip")
def failer(self: Any, key: str, seconds: float = 0.0) -> None:
    """Holds ``r:<key>`` for ``seconds``, then fails."""
    _hold(self, key, seconds)
    raise RuntimeError(f"failed on purpose: {key}")


@app.task(
    bind=True,
    base=RedlockTask,
    name="review.requeuer",
    lock_key="r:<key>",
    lock_contended="fail",
    lock_enqueue="return_existing",
    acks_late=True,
)
def requeuer(self: Any, key: str) -> int:
    """Sends its message back to the queue on its first try (``Reject(requeue=True)``: not now);
    runs on the next."""
    tries = int(records().incr(f"tries:{key}"))
    record(key, "start", task_id=self.request.id, tries=tries)
    if tries == 1:
        raise Reject("not now", requeue=True)
    return tries


@celery_signals.task_postrun.connect
def _hold_back_the_requeue(
    sender: Any = None, task_id: str = "", state: str = "", args: Any = (), **_: Any
) -> None:
    """Between a rejected run's end and its message's requeue (which the worker does after the
    run's postrun), let the test publish: the window any publisher may hit, held open."""
    if getattr(sender, "name", "") == "review.requeuer" and state == "REJECTED":
        key = str(args[0])
        record(key, "rejected", task_id=task_id)
        wait_for(lambda: records().exists(f"go:{key}"), 10.0)


def _replacement_came(key: str, task_id: str) -> bool:
    """Whether the replacement (the same task id) was refused the lock, or started."""
    mine = [e["event"] for e in events(key) if e.get("task_id") == task_id]
    return "refused" in mine or mine.count("start") > 1


@lock_signals.lock_contended.connect
def _refused(sender: Any = None, key: str = "", task_id: str = "", policy: str = "", **_: Any) -> None:
    if str(getattr(sender, "name", "")).startswith("review."):
        record(key, "refused", task_id=task_id, policy=policy)


@lock_signals.lock_released.connect
def _released(sender: Any = None, key: str = "", task_id: str = "", state: str = "", **_: Any) -> None:
    if str(getattr(sender, "name", "")).startswith("review."):
        record(key, "released", task_id=task_id, state=state)
