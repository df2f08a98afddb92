"""A retried run's copy is published only once the run's own state is stored.

INVARIANT (a retry's outcome is the copy's): the copy of a locked run that retries, for its
lock (``contend.retry``) or by its body's own ``self.retry()``, reaches the broker only after
the tracer has stored the run's RETRY state. The run's lock is released as its body ends,
before that store; a copy published earlier (as Celery's ``Task.retry`` does) can take the free
lock at once, finish on another worker and store SUCCESS, and the RETRY of the run before it,
stored after, then stands for ever: the work done, its result never seen. With
``lock_enqueue``, the run's lock becomes the copy's marker as the run ends (pending until the
copy is published), so the key stays taken from the run to its copy.

How: the copy is handed to the run (:meth:`.runstate.RunState.retry_later`) instead of being
published; :func:`publish_held_back` publishes it on ``task_retry`` (sent right after the
RETRY store), or on ``task_postrun`` when that store or the task's ``on_retry`` raised (both
skip ``task_retry``), or the body caught the ``Retry`` it raised and ended otherwise. At most
once: the run hands its copy out once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .runstate import RunState, run_of

logger = logging.getLogger("celery_redlock.hooks")

# The run whose body's self.retry() is under way on this thread (a green thread under gevent,
# whose monkeypatching makes this local to it): Celery's Task.retry publishes its copy through
# the task's apply_async, which hands it to that run instead (see held_back).
_retrying = threading.local()


def own_retry(task: Any, retry: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``retry(*args, **kwargs)`` (Celery's ``Task.retry``) with the copy it publishes held back
    until the run's state is stored. An eager run publishes nothing. ``retry(throw=False)``
    publishes at once, as Celery does: the body goes on, under its lock, and the copy is queued
    meanwhile (and waits for that lock, see contend.contended); the run stores no RETRY."""
    run = run_of(task.request)
    throw = kwargs.get("throw", args[3] if len(args) > 3 else True)
    if run is None or not throw or run.retry is not None or getattr(task.request, "is_eager", False):
        return retry(*args, **kwargs)
    _retrying.run = run
    try:
        return retry(*args, **kwargs)
    finally:
        _retrying.run = None  # also when Celery did not publish (MaxRetriesExceededError)


def held_back(
    task: Any,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    mark: Callable[..., dict[str, Any]],
) -> bool:
    """Whether this publish (from ``apply_async``) is a body's retry copy, now handed to its run
    to publish once the run's state is stored, with the options ``mark(task, run, args, kwargs,
    task_id, options)`` gives it (its enqueue marker). One look at a thread-local for any other
    publish."""
    run: RunState | None = getattr(_retrying, "run", None)
    if run is None:
        return False
    _retrying.run = None  # the one publish Celery's retry makes; anything after it goes out
    options = mark(task, run, args, kwargs, task_id, options)
    run.retry_later(task.signature(args, kwargs, task_id=task_id, **options))
    return True


def publish_held_back(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Publish the copy ``request``'s run held back, now that the tracer has stored its state.
    A publish that fails leaves nothing to run the task again: the run is recorded as failed
    with that error (where the task stores errors), never left to read RETRY for ever."""
    run = run_of(request)
    sig = None if run is None else run.take_retry()
    if sig is None:
        return  # the run retried nothing, or its copy is out already
    try:
        sig.apply_async()
    except Exception as exc:
        task_id = getattr(request, "id", None)
        logger.error(
            "task %s[%s]: its retry could not be published (%s: %s); the run is recorded as failed",
            getattr(sender, "name", "?"),
            task_id,
            type(exc).__name__,
            exc,
        )
        ignored = getattr(sender, "ignore_result", False) or getattr(request, "ignore_result", False)
        if ignored and not getattr(sender, "store_errors_even_if_ignored", False):
            return  # the task stores no result, as Celery would store none of this failure
        try:
            sender.backend.mark_as_failure(task_id, exc, request=request)
        except Exception:
            logger.exception("task %s: its failure could not be stored either", task_id)
