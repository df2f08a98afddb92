"""What a worker checks at start: settings and options that would fail every locked run, and
masters that do not answer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import signals as celery_signals

from ..errors import ConfigError
from ..lock.probe import unanswered
from ..lock.redlock import Redlock
from . import enqueue, hooks
from . import options as option_table
from .lockoptions import LockOptions
from .settings import (
    DEPRECATED_SETTINGS,
    app_settings_and_redlock,
)
from .slots import slot_period

logger = logging.getLogger("celery_redlock.task")


def is_locked(task: Any) -> bool:
    """Whether ``task`` is a locked task (its class has :class:`~.task.RedlockTaskMixin`)."""
    return getattr(task, "_redlock_task", False) is True


def startup_checks(sender: Any = None, **_: Any) -> None:
    """``worker_init``: stop a worker whose configuration would fail every locked run.

    A worker that went ready with ``redlock_ttl=-1`` would take every locked task off the queue
    only to fail it. This runs in the main process before the pool and the consumer start, so
    ``SystemExit`` ends it at once, with the message (naming the setting) on stderr: logging is
    not set up yet, and Celery's signal dispatch swallows any ``Exception`` a receiver raises.
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        problems = check_app(app)
    except ConfigError as exc:
        raise SystemExit(f"celery-redlock: the worker cannot start: {exc}") from None
    for message in problems:
        logger.warning("%s", message)
    unreachable = probe_masters(app)
    if unreachable:
        logger.warning("%s", unreachable)


def probe_masters(app: Any) -> str:
    """A warning naming the masters that do not answer a PING now ("" when all do, or when the
    app has no locked task). The worker still starts: a master may come up later, and until a
    quorum answers, locked runs retry (they are never skipped or failed as duplicates)."""
    if not any(is_locked(t) for t in app.tasks.values()):
        return ""
    settings, redlock = app_settings_and_redlock(app)
    missing = unanswered(redlock.masters, max(1.0, settings.request_timeout))
    if not missing:
        return ""
    named = "; ".join(f"{name} ({why})" for name, why in missing.items())
    verdict = (
        "locked runs will retry until a quorum answers"
        if len(redlock.masters) - len(missing) < redlock.quorum
        else "a quorum still answers"
    )
    return (
        f"redlock_masters: {len(missing)} of {len(redlock.masters)} masters did not answer at "
        f"start: {named}; {verdict}"
    )


def check_app(app: Any) -> list[str]:
    """The start-up checks for ``app``.

    Raises :class:`ConfigError` for what would fail every locked run: a bad ``redlock_*``
    setting, masters the Redlock refuses, a task option the settings make invalid. It takes the
    path a locked run takes (:func:`app_redlock`, then each task's options), so nothing a run
    would refuse passes here. Returns the warnings: what works, but weakens or defeats the locks.
    """
    locked = [t for t in app.tasks.values() if is_locked(t)]
    if not locked:
        return []
    settings, redlock = app_settings_and_redlock(app)
    problems = [
        f"{name} is set but has no effect: {why}"
        for name, why in DEPRECATED_SETTINGS.items()
        if app.conf.get(name) is not None
    ]
    if len(settings.masters) % 2 == 0:
        problems.append(
            f"redlock_masters: {len(settings.masters)} masters is even; a quorum of "
            f"{len(settings.masters) // 2 + 1} tolerates no more failures than "
            f"{len(settings.masters) - 1} would"
        )
    broker = str(app.conf.broker_url or "")
    visibility = (app.conf.broker_transport_options or {}).get("visibility_timeout", 3600)
    for task in locked:
        _refuse_bad_options(task, redlock)
        options = task.lock_options(settings)
        problems += _task_warnings(app, task, options, broker, visibility)
    return problems


def _refuse_bad_options(task: Any, redlock: Redlock) -> None:
    """A :class:`ConfigError` for an option of ``task`` that every run of it would refuse."""
    # Celery sets task_annotations (and code may set attributes) after the class was made:
    # what reaches a run is checked again here, as the class was at its creation.
    option_table.refuse_unknown(vars(task).items(), task.name)
    option_table.refuse_unknown(vars(type(task)).items(), task.name, type(task).__qualname__)
    option_table.check_values(task, task.name)
    if task.lock_ttl is not None:
        # Refused by the Redlock at every acquire otherwise, under the name "ttl".
        redlock.check_ttl(f"task {task.name!r}: lock_ttl", task.lock_ttl)


def _task_warnings(app: Any, task: Any, options: LockOptions, broker: str, visibility: Any) -> list[str]:
    """What in ``task``'s options works, but weakens or defeats its lock; ``broker`` and
    ``visibility`` are the app's broker URL and Redis visibility timeout."""
    warnings = []
    if not options.heartbeat:
        warnings.append(
            f"task {task.name!r}: lock_heartbeat is off, so its lock lasts lock_ttl "
            f"{options.ttl} s; a run longer than that is no longer exclusive"
        )
    if options.slot is not None and options.release == "on_expiry":
        period = slot_period(options.slot, time.time())
        if options.ttl < period:
            warnings.append(
                f"task {task.name!r}: lock_slot with lock_release='on_expiry' and lock_ttl "
                f"{options.ttl:g} s, shorter than its schedule's period ({period:g} s): copies "
                "of one tick from beats that do not share one leader (two plain beats) arrive "
                "up to a period apart, and a copy that comes after the lock expired runs again"
            )
    acks_late = task.acks_late if task.acks_late is not None else app.conf.task_acks_late
    if acks_late and broker.startswith(("redis://", "rediss://", "redis+socket://")):
        longest = max(options.ttl, float(task.time_limit or app.conf.task_time_limit or 0))
        if visibility < longest:
            warnings.append(
                f"task {task.name!r}: acks_late with a Redis broker whose visibility_timeout "
                f"({visibility} s) is shorter than its lock TTL or time limit ({longest} s): "
                "the broker redelivers a running task, and the copy waits on the lock"
            )
    return warnings


def connect_hooks() -> None:
    """The worker and publish hooks, connected once a locked task is defined."""
    hooks.connect(
        (celery_signals.worker_init, startup_checks),
        (celery_signals.task_revoked, enqueue.release_revoked_marker),
    )
