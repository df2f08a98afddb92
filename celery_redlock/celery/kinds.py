"""What :class:`~celery_redlock.celery.beat.RedlockScheduler` knows of each kind of scheduler it
wraps: whether its state is the process's own or a store every beat shares, and the few places
where a standby or a new leader must step around the wrapped scheduler's own habits.

A *process-local* kind (celery's ``PersistentScheduler`` and ``Scheduler``) is followed by a
standby running the wrapped bookkeeping itself. A *shared* kind (django-celery-beat's database,
redbeat's Redis) is never touched by a standby, and set up afresh by each new leader; the hooks
below say what that takes for each. They reach into attributes of the wrapped schedulers, each
noted with the versions it was checked against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

logger = logging.getLogger("celery_redlock.beat")


def _leave_as_is(scheduler: Any) -> None:
    pass


def _leave_reserved_as_is(scheduler: Any, reserved: Any) -> None:
    pass


def _forget_database_schedule(scheduler: Any) -> None:
    # django-celery-beat caches the rows it read (re-read only when a row is edited, or every 5
    # minutes), and keeps the runs it has not written yet in _dirty: a former leader's runs, which
    # would now overwrite its successor's newer last_run_at. These attributes are the same from
    # 2.5 to 2.9.
    scheduler._dirty.clear()
    scheduler._initial_read = True
    scheduler._heap = None
    # The rows are read next, and an admin's transaction may commit a new row just after. The
    # scheduler sees an edit only when PeriodicTasks.last_update has moved past _last_timestamp
    # (schedule_changed). A first term starts with None there, which the first check takes as
    # "unchanged" and replaces with the last_update it reads: by then our setup's own writes
    # (which wait for the admin's commit) have moved it past the admin's edit, and the new row
    # waited for the 5-minute re-read. The earliest instant makes the first check re-read the
    # rows once, after the setup. (last_change() read now would not do: it is None until a
    # database's first edit, and the admin's uncommitted edit may be that one.)
    scheduler._last_timestamp = _earliest_change()


def _earliest_change() -> Any:
    # Compared with PeriodicTasks.last_update, which Django reads aware under USE_TZ and naive
    # otherwise: comparing the two kinds raises TypeError.
    import datetime

    from django.conf import settings

    earliest = datetime.datetime.min
    return earliest.replace(tzinfo=datetime.timezone.utc) if settings.USE_TZ else earliest


def _keep_reserved_database_entry(scheduler: Any, reserved: Any) -> None:
    # django-celery-beat saves the entry it holds in _schedule, not the one reserve() returned,
    # and after setup_schedule (update_from_dict) the two are different model objects: the save
    # wrote the *previous* last_run_at, and the next re-read of the rows (the setup's own writes
    # mark the schedule changed) made the tick due again: one tick sent twice at a handover.
    # The reserved entry, carrying the new last_run_at, is the one to save.
    if reserved.name in scheduler._schedule:
        scheduler._schedule[reserved.name] = reserved


def _keep_first_ticks_of_unrun_rows(scheduler: Any) -> None:
    # django-celery-beat counts the first tick of a row that never ran from the row's
    # date_changed (ModelEntry does in 2.9; whatever it counts from, the entry's own
    # last_run_at is what is kept below), and installing the static entries (setup_schedule:
    # update_or_create) saves every row again, moving date_changed to now: a first tick that fell
    # due while nobody led would wait for the next one (a daily job, a day). Before that setup,
    # such a row, if it is due, gets the instant its entry counts from as last_run_at: the same
    # reference, now kept by the store, so the tick is sent, and its send writes the real run
    # over it at once. A row that is not due yet is left alone: its next crontab, solar or
    # aligned tick is the same from either instant (an unaligned interval's first run moves with
    # the save, as at any restart of django-celery-beat). No run is counted (total_run_count
    # stays), and nothing is sent here.
    rows = scheduler.Model._default_manager
    for row in rows.filter(enabled=True, last_run_at__isnull=True, start_time__isnull=True):
        entry = scheduler.Entry(row, app=scheduler.app)
        if entry.last_run_at is not None and scheduler.is_due(entry)[0]:
            rows.filter(pk=row.pk, last_run_at__isnull=True).update(last_run_at=entry.last_run_at)


def _turn_redbeat_lock_off(scheduler: Any) -> None:
    # redbeat's own lock, on one Redis, lets one beat process run at all: the others block in
    # beat_init. Ours takes its place. The setting stays as the user wrote it; only this
    # scheduler's copy is cleared, before beat_init reads it.
    if scheduler.lock_key:
        logger.info("redbeat's own lock %s is not taken: the leader lock takes its place", scheduler.lock_key)
        scheduler.lock_key = None


@dataclass(frozen=True)
class SchedulerKind:
    """What :class:`RedlockScheduler` knows of one kind of wrapped scheduler.

    ``shared``: its state lives in a store every beat reads (a database, a Redis), so a standby
    leaves it alone; otherwise it lives in the process, and a standby runs the bookkeeping
    itself. ``adopt`` runs once on each new scheduler; ``forget`` drops what a scheduler cached
    of the store in an earlier term as leader, before it sets up again on taking the lead;
    ``before_setup`` runs next, to keep in the store what that setup would otherwise move.
    """

    name: str
    classes: tuple[str, ...]  # "module:Class" of the classes this kind covers
    shared: bool
    adopt: Callable[[Any], None] = _leave_as_is
    forget: Callable[[Any], None] = _leave_as_is
    before_setup: Callable[[Any], None] = _leave_as_is
    reserved: Callable[[Any, Any], None] = _leave_reserved_as_is  # before the run is written
    # Whether it asks RedlockScheduler.is_due (celery's tick does): only then can intervals be
    # aligned (redlock_beat_align_intervals).
    aligns: bool = True


LOCAL = SchedulerKind("process-local", ("celery.beat:PersistentScheduler", "celery.beat:Scheduler"), False)
SHARED_KINDS = (
    SchedulerKind(
        "django-celery-beat",
        ("django_celery_beat.schedulers:DatabaseScheduler",),
        True,
        forget=_forget_database_schedule,
        before_setup=_keep_first_ticks_of_unrun_rows,
        reserved=_keep_reserved_database_entry,
    ),
    # redbeat's tick asks each entry's own is_due, never the scheduler's: no alignment. Nothing
    # to keep at a takeover: its setup (update_from_dict) keeps each stored last_run_at, and an
    # entry that never ran counts from the one written when it was created (save() writes it
    # with HSETNX; redbeat 2.4), so a tick that fell due while nobody led is due when the new
    # leader reads the store.
    SchedulerKind(
        "redbeat", ("redbeat.schedulers:RedBeatScheduler",), True, adopt=_turn_redbeat_lock_off, aligns=False
    ),
)
# What the error for an unknown scheduler names; redbeat documents the shorter path.
KNOWN_TO_WORK = (
    "celery.beat:PersistentScheduler",
    "celery.beat:Scheduler",
    "django_celery_beat.schedulers:DatabaseScheduler",
    "redbeat:RedBeatScheduler",
)
SCHEDULER_STATES = ("local",)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def scheduler_kind(inner: type, state: str | None) -> SchedulerKind:
    """The kind of ``inner`` (the class to wrap), given ``redlock_beat_scheduler_state``.

    A subclass of a shared kind is that kind (its state is where its base keeps it); a process-
    local kind is recognised only by its exact class, since a subclass may keep state elsewhere.
    """
    path = _class_path(inner)
    for kind in SHARED_KINDS:
        if any(_class_path(cls) in kind.classes for cls in inner.__mro__):
            if state == "local":
                raise ConfigError(
                    f"redlock_beat_scheduler_state = 'local' does not fit {path!r}: it is a "
                    f"{kind.name} scheduler, whose state every beat shares; unset the setting"
                )
            return kind
    if path in LOCAL.classes or state == "local":
        return LOCAL
    raise ConfigError(
        f"redlock_beat_scheduler: RedlockScheduler does not know how a standby may follow {path!r} "
        "without writing state the leader relies on. Known to work: "
        f"{', '.join(KNOWN_TO_WORK)}. If this scheduler keeps its state only in the beat process "
        "(memory, a local file), set redlock_beat_scheduler_state = 'local'."
    )
