"""Worker lifecycle hooks: what makes RedlockTask work under every pool.

Connected (once, with fixed ``dispatch_uid``) when the first RedlockTask class is defined or a
RedlockScheduler starts, never at import; the start-up checks are :mod:`.task`'s own:

- ``before_task_publish``: stamps the publish time (:data:`.slots.PUBLISHED_HEADER`)
  into every message that has none, in the publishing process (beat, a web process), so
  ``lock_slot`` can tell which schedule tick a message belongs to; and a publish id
  (:data:`PUBLISH_ID_HEADER`), the identity of one publish that its broker redeliveries and its
  retries carry, so a run can tell an earlier attempt of itself from another publish that reused
  its task id (see ``contend.contended``).
- ``worker_init`` (main process): the start-up checks. A configuration that would fail every
  locked run stops the worker before it consumes; what only weakens the locks is logged.
- ``worker_process_init`` (each prefork child, after fork): builds the child's own Redlock, so
  its connections are made in the child; the heartbeat thread starts on the child's first lock.
- ``task_postrun``: releases the lock of a run that ended ignored or rejected (no after_return),
  or was interrupted by a terminate signal (``revoke(terminate=True)`` raises SystemExit in a
  pool child, and the tracer still sends postrun).
- ``task_retry``: publishes the copy a lock retry held back until its run's RETRY state was
  stored (see ``contend.retry``); ``task_postrun`` publishes it if that store or the task's
  ``on_retry`` raised, which skips ``task_retry``.
- ``task_revoked`` with ``terminated``: releases the lock if the run was in this process.
- ``task_unknown`` / ``task_rejected`` (a message the consumer discards: a task this worker does
  not register, a content type it does not accept), ``task_failure`` (a pool child killed while
  its run waited for the lock), with ``task_received`` keeping the marked requests for the
  latter: delete the ``lock_enqueue`` marker of a message that ends without a run that took its
  key over (:mod:`.discarded`).
- ``worker_process_shutdown`` / ``worker_shutdown``: releases every lock still held here.
- ``worker_init`` / ``worker_shutdown``: the Prometheus metrics, when ``redlock_metrics`` asks
  for them (:mod:`.metrics`: nothing is imported or connected otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any

from celery import signals as celery_signals
from celery.states import SUCCESS

from ..errors import ConfigError
from . import discarded, held
from .runstate import run_of
from .settings import app_settings_and_redlock, close_app_redlock
from .slots import PUBLISHED_HEADER

logger = logging.getLogger("celery_redlock.hooks")


#: One publish's identity: random, kept by its redeliveries and retries (which carry it over).
PUBLISH_ID_HEADER = "redlock_publish"


def stamp_publish_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is None:
        return
    if headers.get(PUBLISHED_HEADER) is None:
        headers[PUBLISHED_HEADER] = time.time()
    if headers.get(PUBLISH_ID_HEADER) is None:
        headers[PUBLISH_ID_HEADER] = secrets.token_hex(8)


def release_after_run(
    sender: Any = None, task_id: str | None = None, state: str | None = None, **_: Any
) -> None:
    held.finish_after_run(sender, task_id, state or "UNKNOWN")
    if state != SUCCESS:  # a run that succeeded retried nothing: the usual run pays one compare
        # The tracer sends postrun whatever happened before it: a RETRY store that raised (a
        # backend down) or a task's own on_retry that raised skip task_retry, and the lock
        # retry held back for it is published here instead.
        publish_lock_retry(sender, getattr(sender, "request", None))


def publish_lock_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Publish the lock retry ``request``'s run held back (``contend.retry``), now that the
    tracer has stored its RETRY state (``task_retry``; ``task_postrun`` when that store or the
    task's ``on_retry`` raised, which skips ``task_retry``). At most once: the run hands its
    copy out once. A publish that fails leaves nothing to run the task again: the run is
    recorded as failed with that error (where the task stores errors), never left to read
    RETRY for ever."""
    run = run_of(request)
    sig = None if run is None else run.take_retry()
    if sig is None:
        return  # not a lock retry (the body's own self.retry() published its copy)
    try:
        sig.apply_async()
    except Exception as exc:
        task_id = getattr(request, "id", None)
        logger.error(
            "task %s[%s]: its lock retry could not be published (%s: %s); the run is recorded as failed",
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


def release_revoked(request: Any = None, terminated: bool = False, **_: Any) -> None:
    task_id = getattr(request, "id", None) or getattr(request, "task_id", None)
    if terminated and task_id:
        held.release_task(str(task_id), "task revoked with terminate")


def release_at_shutdown(**_: Any) -> None:
    held.release_all("worker process shutting down")
    close_app_redlock()


def prepare_child(**_: Any) -> None:
    from celery import current_app

    # A bad configuration stopped the worker at start; one made since (a change to app.conf)
    # fails each locked run with the ConfigError, which is where it is reported.
    with contextlib.suppress(ConfigError):
        app_settings_and_redlock(current_app)


# The worker this process runs in, noted at ``worker_init`` in its main process (forked pool
# children inherit it): its time limits can come from its command line (``--time-limit``), which
# puts them on the worker, not in app.conf. Read when a run needs them (see contend._wait_cap);
# the worker sets them after ``worker_init``.
_worker: Any = None


def note_worker(sender: Any = None, **_: Any) -> None:
    global _worker
    _worker = sender


def worker_time_limits() -> tuple[float | None, float | None]:
    """The (hard, soft) time limits of the worker this process runs in, as its pool applies
    them to a run whose message names none; (None, None) outside a worker."""
    return getattr(_worker, "time_limit", None), getattr(_worker, "soft_time_limit", None)


def hard_time_limit(task: Any, request: Any, app_limit: Any) -> Any:
    """The hard time limit that applies to a run of ``task``: the call's (its message's
    ``timelimit``), else the task's, else this worker's own (``--time-limit``), else the app's
    (``app_limit``, its ``task_time_limit``); falsy when it has none. The one rule for both
    the heartbeat's cap and the cap on a wait for the lock."""
    limits = getattr(request, "timelimit", None) or (None, None)
    return limits[0] or getattr(task, "time_limit", None) or getattr(_worker, "time_limit", None) or app_limit


def start_metrics(**kwargs: Any) -> None:
    from . import metrics

    metrics.worker_init(**kwargs)


def stop_metrics(**kwargs: Any) -> None:
    from . import metrics

    metrics.worker_shutdown(**kwargs)


_HOOKS = (
    (celery_signals.before_task_publish, stamp_publish_time),
    (celery_signals.task_postrun, release_after_run),
    (celery_signals.task_retry, publish_lock_retry),
    (celery_signals.task_revoked, release_revoked),
    # A marker lasts no longer than its message (see discarded.py's INVARIANT).
    (celery_signals.task_unknown, discarded.drop_discarded_marker),
    (celery_signals.task_rejected, discarded.drop_discarded_marker),
    (celery_signals.task_received, discarded.note_marked),
    (celery_signals.task_failure, discarded.drop_failed_marker),
    (celery_signals.worker_process_init, prepare_child),
    (celery_signals.worker_process_shutdown, release_at_shutdown),
    (celery_signals.worker_shutdown, release_at_shutdown),
    (celery_signals.worker_init, note_worker),
    (celery_signals.worker_init, start_metrics),
    (celery_signals.worker_shutdown, stop_metrics),
)


_connected = False


def connect(*extra: tuple[Any, Any]) -> None:
    """Connect every hook, plus ``extra`` (signal, handler) pairs; idempotent and cheap after
    the first call.

    Nothing is connected at import: a process that imports the package but defines no
    RedlockTask (or uses the lock core alone) publishes its messages untouched.
    """
    global _connected
    if _connected and not extra:
        return
    for signal, handler in (*_HOOKS, *extra):
        signal.connect(handler, weak=False, dispatch_uid=f"celery_redlock.{handler.__name__}")
    _connected = True
