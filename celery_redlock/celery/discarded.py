"""The markers of messages that end in the worker without a run that took their key over
(``lock_enqueue``, see :mod:`.enqueue`): deleted by the worker that ends them, so the key is
free at once instead of after ``lock_enqueue_ttl``.

INVARIANT (a marker lasts no longer than its message): every way a worker ends a marked
message deletes its marker, by its value (compare-and-delete, on the lock key and on the task's
side key), so a marker already taken over by the run (the key then holds the run's token) or
replaced is left alone. Besides the run's own exit paths and the ``task_revoked`` and
``lock_contended`` hooks (:mod:`.queued`), these:

- :func:`drop_discarded_marker` (``task_unknown``, ``task_rejected``): the consumer discards the
  message before any run (a task this worker does not register, as in a rolling deploy; a
  content type it does not accept; a malformed message);
- :func:`drop_failed_marker` (``task_failure``): a run that failed before it took its key over,
  above all a pool child killed while its run waited for the lock (the hard time limit,
  SIGKILL, the OOM killer): the child runs nothing of its own again, and the worker's main
  process, which records the failure, deletes the marker. The hard time limit's failure is sent
  without the run's request, so the main process keeps the marked requests it received
  (:func:`note_marked`, ``task_received``; weakly, for as long as the worker keeps them).

A worker that does not run celery_redlock at all (no locked task defined, no masters
configured) connects none of this: a marked message it discards keeps its marker for
``lock_enqueue_ttl``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from .._fork import on_fork_in_child
from ..lock import markers
from ..lock.markers import side_key
from .queued import marker_of
from .runstate import run_of
from .settings import app_settings_and_redlock

logger = logging.getLogger("celery_redlock.enqueue")

# The marked requests this process has received, by (task id, marker value); weakly, so an entry
# lasts as long as the worker keeps its request (see note_marked). Written by the consumer, read
# by whichever thread sends a failure: under _mutex.
_marked: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
_mutex = threading.Lock()


def _after_fork_in_child() -> None:
    global _mutex
    _mutex = threading.Lock()  # the consumer may have held it at the fork
    _marked.clear()  # the parent's requests: a pool child receives none of its own


on_fork_in_child(_after_fork_in_child)


def note_marked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_received`` (the worker's main process): keep a marked message's request, so that a
    failure sent without it (the hard time limit's) can still find its marker."""
    carried = marker_of(request)
    task_id = getattr(request, "id", None)
    if carried is not None and isinstance(task_id, str):
        with _mutex:
            _marked[(task_id, carried[1])] = request


def drop_discarded_marker(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    """``task_unknown`` / ``task_rejected``: the consumer discarded a message that will never
    run; delete the marker it carries."""
    carried = marker_of(message)
    if carried is None:
        return
    headers = getattr(message, "headers", None)
    headers = headers if isinstance(headers, Mapping) else {}
    owner = name or headers.get("task")
    _drop(getattr(sender, "app", None), owner, carried, headers.get("id"), "discarded by the worker")


def drop_failed_marker(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """``task_failure``: delete the marker of a failed run's message unless the run took the key
    over (then no marker is left, and the run's exit path released the key)."""
    request = getattr(sender, "request", None)
    if task_id is None or getattr(request, "id", None) != task_id:
        request = None  # the hard time limit's failure: sent without the run's request
    if request is not None:
        run = run_of(request)
        if run is not None and run.held is not None:
            return  # the run took its key over: no marker left to delete (the usual failure)
        found = [marker_of(request)]
    else:
        with _mutex:
            kept = [request for (tid, _), request in _marked.items() if tid == task_id]
        found = [marker_of(request) for request in kept]
    for carried in found:
        if carried is not None:
            _drop(getattr(sender, "app", None), getattr(sender, "name", None), carried, task_id, "failed")


def _drop(app: Any, owner: Any, carried: tuple[str, str], task_id: Any, why: str) -> None:
    """Delete the marker ``carried`` (resource name, value), on the lock key and, when the task
    is known, on its side key; a failure is logged, never raised (a signal handler's)."""
    if app is None:
        from celery import current_app

        app = current_app
    try:
        redlock = app_settings_and_redlock(app)[1]
        side = side_key(redlock.key_prefix, carried[0], owner) if isinstance(owner, str) else None
        markers.drop(redlock, carried[0], carried[1], side)
    except Exception:  # a signal handler's failure is logged by nobody else
        logger.exception("deleting the marker of task %s (%s) failed", task_id or "?", why)
        return
    logger.info("task %s %s: its marker on %s deleted", task_id or "?", why, carried[0])
