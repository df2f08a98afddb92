"""A task's lock options: checked at class creation, resolved against the app's settings per run."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from celery import Task

from ..errors import ConfigError
from ..lock.heartbeat import longest_interval
from ..lock.redlock import CLOCK_DRIFT_FLOOR
from . import enqueue
from . import options as option_table
from .settings import (
    DEFAULTS,
    RedlockSettings,
)


@dataclass(frozen=True)
class LockOptions:
    """One task's lock options, with the app's settings filled in."""

    ttl: float
    contended: str
    reentrant: bool
    fenced: bool
    wait_timeout: float
    retry_backoff: float
    retry_backoff_max: float
    max_retries: int | None
    heartbeat: bool
    # The interval the heartbeat extends at (always a number: the default is resolved here).
    heartbeat_interval: float
    # lock_max_hold as given; None: capped by the run's own time limit where the pool enforces
    # it (see RedlockTaskMixin._redlock_max_hold), else not at all.
    max_hold: float | None
    release: str
    slot: Any

    def backoff(self, attempt: int) -> float:
        """The wait before lock retry ``attempt + 1``: full jitter under a doubling ceiling."""
        return random.uniform(0.0, min(self.retry_backoff_max, self.retry_backoff * 2.0**attempt))


def check_static_options(cls: type[Task], task_name: str) -> None:
    """Fail at class creation on option values that are wrong whatever the settings."""

    def name(option: str) -> str:
        return f"task {task_name!r}: {option}"

    option_table.check_values(cls, task_name)
    if cls.lock_ttl is not None and cls.lock_heartbeat_interval is not None:
        # The request timeout is the app's, known at worker start (checked again there): here
        # only what no setting could make right is refused.
        drift = cls.lock_ttl * DEFAULTS["redlock_drift_factor"] + CLOCK_DRIFT_FLOOR
        longest = longest_interval(cls.lock_ttl, 0.0, drift)
        if cls.lock_heartbeat_interval > longest:
            raise ConfigError(
                f"{name('lock_heartbeat_interval')} {cls.lock_heartbeat_interval:g} s cannot keep a "
                f"lock_ttl of {cls.lock_ttl:g} s alive: the largest interval allowed is under "
                f"{longest:.3g} s (lock_ttl - drift - 2 x redlock_request_timeout)"
            )
    if cls.lock_fenced and cls.lock_reentrant:
        raise ConfigError(f"task {task_name!r}: lock_fenced cannot be combined with lock_reentrant=True")
    enqueue.check_task_options(cls, task_name)
    if cls.lock_slot not in (None, True):
        from .slots import slot_time

        try:
            slot_time(cls.lock_slot, 0.0)
        except ConfigError as exc:
            raise ConfigError(f"task {task_name!r}: {exc}") from None


def resolve_options(task: Task, settings: RedlockSettings) -> LockOptions:
    ttl = float(option_table.resolved(task, "lock_ttl", settings))
    slot = task.lock_slot
    if slot is True:
        slot = beat_schedule_of(task)
    return LockOptions(
        ttl=ttl,
        contended=option_table.resolved(task, "lock_contended", settings),
        reentrant=option_table.resolved(task, "lock_reentrant", settings),
        fenced=option_table.resolved(task, "lock_fenced", settings),
        wait_timeout=option_table.resolved(task, "lock_wait_timeout", settings),
        retry_backoff=option_table.resolved(task, "lock_retry_backoff", settings),
        retry_backoff_max=option_table.resolved(task, "lock_retry_backoff_max", settings),
        max_retries=option_table.resolved(task, "lock_max_retries", settings),
        heartbeat=task.lock_heartbeat,
        heartbeat_interval=heartbeat_interval(task, ttl, settings),
        max_hold=task.lock_max_hold,
        release=task.lock_release,
        slot=slot,
    )


def heartbeat_interval(task: Task, ttl: float, settings: RedlockSettings) -> float:
    """The interval this task's heartbeat extends its lock at: the option, else the setting,
    else a third of the TTL (less where the rule needs it). Refused, naming the task, the option
    and the largest interval allowed, when an extension could not land before validity ends
    with one round missed (see :func:`celery_redlock.lock.heartbeat.longest_interval`)."""
    drift = ttl * settings.drift_factor + CLOCK_DRIFT_FLOOR
    longest = longest_interval(ttl, settings.request_timeout, drift)
    option = "lock_heartbeat_interval" if task.lock_heartbeat_interval is not None else None
    interval = task.lock_heartbeat_interval
    if interval is None and settings.heartbeat_interval is not None:
        option, interval = "redlock_heartbeat_interval", settings.heartbeat_interval
    if interval is None:
        if longest > 0:
            return min(ttl / 3, longest)
        raise ConfigError(
            f"task {task.name!r}: lock_ttl {ttl:g} s is too short to be kept alive: with "
            f"redlock_request_timeout {settings.request_timeout:g} s it must exceed "
            f"{ttl - longest:.3g} s (drift + 2 x request_timeout: an extension must land before "
            "validity ends even when one round is missed)"
        )
    if interval <= longest:
        return float(interval)
    raise ConfigError(
        f"task {task.name!r}: {option} {interval:g} s cannot keep its lock alive: with lock_ttl "
        f"{ttl:g} s and redlock_request_timeout {settings.request_timeout:g} s the largest "
        f"heartbeat interval allowed is {max(0.0, longest):.3g} s (lock_ttl - drift - 2 x "
        "request_timeout: an extension must land before validity ends even when one round is "
        "missed)"
    )


def beat_schedule_of(task: Task) -> Any:
    entries = [
        entry.get("schedule")
        for entry in (task.app.conf.beat_schedule or {}).values()
        if entry.get("task") == task.name
    ]
    schedules = {repr(s): s for s in entries}
    if len(schedules) != 1:
        found = "none" if not schedules else ", ".join(schedules)
        raise ConfigError(
            f"task {task.name!r}: lock_slot=True takes the period from the task's beat_schedule "
            f"entry, but exactly one schedule is needed (found {found}); give lock_slot the "
            "schedule itself (seconds, timedelta or crontab)"
        )
    return next(iter(schedules.values()))
