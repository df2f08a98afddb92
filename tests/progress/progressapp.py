"""The Celery app the progress tests' real workers run (``celery -A tests.progress.progressapp``).

Configured from the environment, so the workers and the test process build the same app:
``PROGRESS_BROKER`` (broker URL), ``PROGRESS_BACKEND`` (result backend), ``PROGRESS_RECORDS``
(the Redis the history is written to) and ``PROGRESS_MASTERS`` (comma-separated lock masters).

One task per ``lock_contended`` mode, all with the same body and ``lock_key="step:<key>"``. A key
is ``<tag>.<name>``: everything about it is appended, as one JSON object per event, to the Redis
list ``progress:<tag>``, so each test (each hypothesis example) reads only its own history.
Every time is ``time.time()``: all processes run on this one host, so they share one clock.

The events (see ``checker.py`` for what each rule reads from them):

- ``start`` and ``end``: written by the body itself, first and last thing. ``start`` also carries
  when this delivery's attempt began (``t_try``, at ``task_prerun``, before the lock is asked
  for) and when the lock was granted (``t_acquired``, at ``lock_acquired``) with how long that
  acquire took (``elapsed``); ``run`` tells two executions of one task id apart.
- ``refused``: a ``lock_contended`` receiver: the attempt did not get the lock, and ``policy``
  says what happens next (retry, skip, fail, exhausted). ``t_try`` and ``t`` (the signal) bracket
  the decision; ``holder`` is the task id the masters named as holding (skip and fail only).
- ``visible``: a ``task_success`` receiver, which Celery calls after it stored the result and
  published the chain's next link: the run's completion is visible from then on.
- ``released``: a ``lock_released`` receiver: the release has been sent.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from celery import signals as celery_signals

from celery_redlock import RedlockTask
from celery_redlock.celery import signals as lock_signals

from ..workerapp import Records, worker_app
from .checker import holder_task_id

MODES = ("retry", "skip", "fail", "wait")
KEY_PREFIX = "step:"

app = worker_app("progress", "PROGRESS", result_expires=3600)
records = Records("PROGRESS_RECORDS")
# What happened to a delivery before its body (or its refusal) is recorded, by task id: each
# delivery of a task id runs in one thread of one process, from task_prerun to its end.
_tries: dict[str, float] = {}
_acquired: dict[str, tuple[float, float]] = {}


def log_name(key: str) -> str:
    """The history list of a key ``<tag>.<name>``."""
    return f"progress:{key.split('.', 1)[0]}"


def record(key: str, event: str, **fields: Any) -> None:
    """Append one event about ``key`` (the task's argument, or its lock name ``step:<key>``)."""
    fields.setdefault("t", time.time())
    key = key.removeprefix(KEY_PREFIX)
    records().rpush(log_name(key), json.dumps({"event": event, "key": key, "pid": os.getpid(), **fields}))


def _body(task: Any, key: str, seconds: float) -> str:
    task_id = task.request.id
    run = uuid.uuid4().hex
    t_acquired, elapsed = _acquired.pop(task_id, (None, None))
    record(
        key,
        "start",
        task_id=task_id,
        run=run,
        t_try=_tries.pop(task_id, None),
        t_acquired=t_acquired,
        elapsed=elapsed,
        mode=task.lock_contended,
        retries=task.request.retries,
    )
    if seconds:
        time.sleep(seconds)
    record(key, "end", task_id=task_id, run=run)
    return key


def _define(mode: str) -> Any:
    @app.task(
        bind=True,
        base=RedlockTask,
        name=f"progress.{mode}",
        lock_key=f"{KEY_PREFIX}<key>",
        lock_contended=mode,
        lock_wait_timeout=30.0,
        # A lock retry shows in the wall time: the first one waits up to 0.25 s.
        lock_retry_backoff=0.25,
        lock_retry_backoff_max=1.0,
    )
    def step(self: Any, key: str, seconds: float = 0.0) -> str:
        return _body(self, key, seconds)

    return step


retry_step = _define("retry")
skip_step = _define("skip")
fail_step = _define("fail")
wait_step = _define("wait")
STEPS = {"retry": retry_step, "skip": skip_step, "fail": fail_step, "wait": wait_step}


def _ours(sender: Any) -> bool:
    return str(getattr(sender, "name", "")).startswith("progress.")


@celery_signals.task_prerun.connect
def _note_try(sender: Any = None, task_id: str = "", **_: Any) -> None:
    if _ours(sender):
        _tries[task_id] = time.time()


@lock_signals.lock_acquired.connect
def _note_acquired(sender: Any = None, task_id: str = "", elapsed: float = 0.0, **_: Any) -> None:
    if _ours(sender):
        _acquired[task_id] = (time.time(), elapsed)


@lock_signals.lock_contended.connect
def _note_refused(
    sender: Any = None,
    key: str = "",
    task_id: str = "",
    policy: str = "",
    attempt: int = 0,
    error: Any = None,
    **_: Any,
) -> None:
    if not _ours(sender):  # another app's task in this process (the test process runs many)
        return
    described = str(getattr(error, "holder", "") or "")
    record(
        key,
        "refused",
        task_id=task_id,
        policy=policy,
        attempt=attempt,
        t_try=_tries.pop(task_id, None),
        holder=holder_task_id(described),
        holder_text=described,
        held=bool(getattr(error, "contended", True)),
    )


@celery_signals.task_success.connect
def _note_visible(sender: Any = None, **_: Any) -> None:
    if _ours(sender):
        request = sender.request
        record(str(request.args[0]), "visible", task_id=request.id)


@lock_signals.lock_released.connect
def _note_released(sender: Any = None, key: str = "", task_id: str = "", state: str = "", **_: Any) -> None:
    if _ours(sender):
        record(key, "released", task_id=task_id, state=state)
