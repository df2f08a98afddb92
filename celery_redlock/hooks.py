"""Worker lifecycle hooks: what makes RedlockTask work under every pool.

Connected (once, with fixed ``dispatch_uid``) when :mod:`celery_redlock.task` is imported:

- ``before_task_publish``: stamps the publish time (:data:`~celery_redlock.slots.PUBLISHED_HEADER`)
  into every message that has none, in the publishing process (beat, a web process), so
  ``lock_slot`` can tell which schedule tick a message belongs to.
- ``worker_init`` (main process): the start-up checks, logged as warnings.
- ``worker_process_init`` (each prefork child, after fork): builds the child's own Redlock, so
  its connections are made in the child; the heartbeat thread starts on the child's first lock.
- ``task_postrun``: releases the lock of a run that ended ignored or rejected (no after_return),
  or was interrupted by a terminate signal (``revoke(terminate=True)`` raises SystemExit in a
  pool child, and the tracer still sends postrun).
- ``task_revoked`` with ``terminated``: releases the lock if the run was in this process.
- ``worker_process_shutdown`` / ``worker_shutdown``: releases every lock still held here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from celery import signals as celery_signals

from .errors import ConfigError
from .settings import app_redlock, close_app_redlock, read_settings
from .slots import PUBLISHED_HEADER

logger = logging.getLogger("celery_redlock.hooks")


def stamp_publish_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None and headers.get(PUBLISHED_HEADER) is None:
        headers[PUBLISHED_HEADER] = time.time()


def release_after_run(sender: Any = None, task_id: str | None = None, state: str | None = None,
                      **_: Any) -> None:
    from .task import finish_after_run

    finish_after_run(sender, task_id, state or "UNKNOWN")


def release_revoked(request: Any = None, terminated: bool = False, **_: Any) -> None:
    from .task import release_task

    task_id = getattr(request, "id", None) or getattr(request, "task_id", None)
    if terminated and task_id:
        release_task(str(task_id), "task revoked with terminate")


def release_at_shutdown(**_: Any) -> None:
    from .task import release_all

    release_all("worker process shutting down")
    close_app_redlock()


def prepare_child(**_: Any) -> None:
    from celery import current_app

    # A bad configuration is reported once at worker start; each locked task fails with it.
    with contextlib.suppress(ConfigError):
        app_redlock(current_app)


def startup_checks(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    for message in check_app(app):
        logger.warning("%s", message)


def check_app(app: Any) -> list[str]:
    """The start-up warnings for ``app``: what works, but weakens or defeats the locks."""
    from .task import RedlockTaskMixin

    locked = [t for t in app.tasks.values() if isinstance(t, RedlockTaskMixin)]
    if not locked:
        return []
    try:
        settings = read_settings(app.conf)
    except ConfigError as exc:
        return [f"{len(locked)} locked task(s) will fail: {exc}"]
    problems = []
    if len(settings.masters) % 2 == 0:
        problems.append(
            f"redlock_masters: {len(settings.masters)} masters is even; a quorum of "
            f"{len(settings.masters) // 2 + 1} tolerates no more failures than "
            f"{len(settings.masters) - 1} would"
        )
    broker = str(app.conf.broker_url or "")
    visibility = (app.conf.broker_transport_options or {}).get("visibility_timeout", 3600)
    for task in locked:
        try:
            options = task.lock_options(settings)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if not options.heartbeat:
            problems.append(
                f"task {task.name!r}: lock_heartbeat is off, so its lock lasts lock_ttl "
                f"{options.ttl} s; a run longer than that is no longer exclusive"
            )
        acks_late = task.acks_late if task.acks_late is not None else app.conf.task_acks_late
        if acks_late and broker.startswith(("redis://", "rediss://", "redis+socket://")):
            longest = max(options.ttl, float(task.time_limit or app.conf.task_time_limit or 0))
            if visibility < longest:
                problems.append(
                    f"task {task.name!r}: acks_late with a Redis broker whose visibility_timeout "
                    f"({visibility} s) is shorter than its lock TTL or time limit ({longest} s): "
                    "the broker redelivers a running task, and the copy waits on the lock"
                )
    return problems


_HOOKS = (
    (celery_signals.before_task_publish, stamp_publish_time),
    (celery_signals.task_postrun, release_after_run),
    (celery_signals.task_revoked, release_revoked),
    (celery_signals.worker_process_init, prepare_child),
    (celery_signals.worker_process_shutdown, release_at_shutdown),
    (celery_signals.worker_shutdown, release_at_shutdown),
    (celery_signals.worker_init, startup_checks),
)


def connect() -> None:
    """Connect every hook (idempotent)."""
    for signal, handler in _HOOKS:
        signal.connect(handler, weak=False, dispatch_uid=f"celery_redlock.{handler.__name__}")


connect()
