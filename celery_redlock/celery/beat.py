"""An HA ``celery beat``: run several beat processes, and exactly one of them dispatches.

    celery -A proj beat -S celery_redlock.beat:RedlockScheduler
    # or: beat_scheduler = "celery_redlock.beat:RedlockScheduler"

:class:`RedlockScheduler` wraps the scheduler class named by ``redlock_beat_scheduler`` (celery's
``PersistentScheduler`` by default) and lets it send a message only while this process holds the
*leader lock*, a Redlock over ``redlock_masters``.

Why each part is the way it is:

- The lock is kept alive by the process heartbeat thread, not by ``tick()``: a tick may sleep for
  ``beat_max_loop_interval`` (five minutes by default), far longer than a lock TTL that gives a
  failover in seconds.
- Validity is checked again just before every message is sent, and a leader with less than
  ``redlock_beat_min_validity`` seconds left does not send: a leader that was paused or cut off
  from a majority stops before another process can have taken over.
- A standby *follows* the schedule, so that when it takes over it carries on from the current
  slot instead of "catching up" the slots the old leader already sent. How depends on where the
  wrapped scheduler keeps its state (:class:`SchedulerKind`):

  - *process-local* (``PersistentScheduler``: memory and a local shelve file): the standby runs
    the wrapped bookkeeping too (entries advance, nothing is sent);
  - *shared* (django-celery-beat's ``DatabaseScheduler``, redbeat's ``RedBeatScheduler``: a
    database or a Redis every beat reads): the store *is* the follow, and a standby must never
    write it (its tick would record runs it never sent, and the leader would then see nothing
    due). A standby does not even set the wrapped scheduler up; whoever takes the lead drops
    what it may have cached from an earlier term, installs the static entries and reads the store
    afresh. The leader writes each run to the store just before sending it, so a successor finds
    the runs already sent, and a leader that may not send records nothing.

  Any other scheduler is refused at start-up unless ``redlock_beat_scheduler_state = "local"``
  says its state is process-local. The standby ticks every ``redlock_beat_standby_interval``
  seconds and tries to take the lock each time: after the leader dies, a standby dispatches
  within the lock's TTL plus one standby tick.
- Every message the leader sends carries the due time it was fired for (the *slot stamp*,
  header ``redlock_slot``, see :func:`celery_redlock.celery.slots.intended_fire`), so a
  ``lock_slot`` task places it without guessing from the publish time.
- Interval schedules keep celery's meaning by default: a tick ``T`` after the previous run.
  With ``redlock_beat_align_intervals`` they fire at ``anchor + k*T`` instead
  (``redlock_beat_align_anchor``, the epoch by default), which is opt-in because it changes
  what an interval means (a 7-day interval on the epoch's grid fires on Thursdays, 00:00 UTC).

  Why the stamp does not make alignment unnecessary for HA: the stamp says which tick *a sender*
  meant, but without alignment each beat's interval ticks count from its own start, so the
  leader and a standby mean different instants by "the next tick". After a handover the new
  leader's first tick comes at its own phase: anything from just after the old leader's last
  send to a whole period later. Both sends carry honest, different stamps, so the worker runs
  both; what was one tick per period becomes two in one period (or a gap nearly twice as long).
  Aligned, every beat has the same boundaries: the standby follows the leader's ticks exactly,
  its first send is the boundary after the leader's last, and the stamps of successive leaders
  agree (the HA tests count slots this way). crontab and solar entries need no alignment: their
  fire times are the same for every beat, and so are their stamps.
- Slots are decided by each host's wall clock. A leader that shuts down cuts its lock to
  ``redlock_beat_min_validity`` rather than deleting it, and never sends with less than that
  left, so hosts whose clocks disagree by less than ``redlock_beat_min_validity`` never send
  the same slot twice; more skew than that can double a slot at a handover.
- The current leader is written, as JSON (hostname, pid, since), to the key
  ``<lock key>:leader`` on every master with the lock's TTL, refreshed on every extension, so
  anyone can read who leads (:func:`read_leader`).

Leadership changes are logged on ``celery_redlock.beat`` and sent as the signals
:data:`beat_leader_elected` and :data:`beat_leader_lost`. ``beat_leader_lost`` may be sent from
the heartbeat thread (when an extension finds the lock gone); keep its receivers short.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import schedstate, schedule
from celery.utils.dispatch import Signal
from celery.utils.imports import load_extension_class_names, symbol_by_name

from .._fork import on_fork_in_child
from .._validate import choice, flag, instant, number
from ..errors import ConfigError
from ..lock.heartbeat import process_heartbeat
from ..lock.redlock import Redlock
from ..lock.resource import Lock, lock_key
from . import hooks
from .settings import read_settings, refuse_unknown_settings
from .slots import SLOT_HEADER, intended_fire, render

logger = logging.getLogger("celery_redlock.beat")

beat_leader_elected = Signal(
    name="beat_leader_elected",
    providing_args={"lock_name", "hostname", "pid", "validity"},
)
beat_leader_elected.__doc__ = "Sent by a RedlockScheduler that took the leader lock and now dispatches."

beat_leader_lost = Signal(
    name="beat_leader_lost",
    providing_args={"lock_name", "hostname", "pid", "reason", "held_for"},
)
beat_leader_lost.__doc__ = (
    "Sent by a RedlockScheduler that stopped dispatching: its lock was lost, or it shut down."
)

DEFAULT_SCHEDULER = "celery.beat:PersistentScheduler"
DEFAULT_LOCK_TTL = 10.0
DEFAULT_STANDBY_INTERVAL = 1.0
LEADER_SUFFIX = ":leader"
# A standby runs the wrapped tick until nothing is due; this bounds that loop for a schedule
# whose entries claim to be due again at once.
MAX_FOLLOW_STEPS = 1000


# -- the kinds of scheduler a standby knows how to follow ----------------------------------------
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


def _keep_reserved_database_entry(scheduler: Any, reserved: Any) -> None:
    # django-celery-beat saves the entry it holds in _schedule, not the one reserve() returned,
    # and after setup_schedule (update_from_dict) the two are different model objects: the save
    # wrote the *previous* last_run_at, and the next re-read of the rows (the setup's own writes
    # mark the schedule changed) made the tick due again: one tick sent twice at a handover.
    # The reserved entry, carrying the new last_run_at, is the one to save.
    if reserved.name in scheduler._schedule:
        scheduler._schedule[reserved.name] = reserved


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
    of the store in an earlier term as leader, before it sets up again on taking the lead.
    """

    name: str
    classes: tuple[str, ...]  # "module:Class" of the classes this kind covers
    shared: bool
    adopt: Callable[[Any], None] = _leave_as_is
    forget: Callable[[Any], None] = _leave_as_is
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
        reserved=_keep_reserved_database_entry,
    ),
    # redbeat's tick asks each entry's own is_due, never the scheduler's: no alignment.
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


# -- settings ---------------------------------------------------------------------------------------
def _scheduler_class(value: object) -> type:
    if isinstance(value, str):
        aliases = dict(load_extension_class_names("celery.beat_schedulers"))
        try:
            value = symbol_by_name(value, aliases=aliases)
        except Exception as exc:  # ImportError; also a module that fails as it loads (Django unset)
            raise ConfigError(
                f"redlock_beat_scheduler: cannot import {value!r}: {type(exc).__name__}: {exc}"
            ) from None
    if not isinstance(value, type) or not issubclass(value, Scheduler):
        raise ConfigError(f"redlock_beat_scheduler must name a celery.beat.Scheduler subclass, got {value!r}")
    if issubclass(value, RedlockScheduler):
        raise ConfigError(
            "redlock_beat_scheduler names a RedlockScheduler; it must name the scheduler to wrap, "
            f"such as {DEFAULT_SCHEDULER!r}"
        )
    return value


@dataclass(frozen=True)
class BeatSettings:
    """The ``redlock_beat_*`` settings, validated."""

    lock_name: str
    lock_ttl: float
    min_validity: float
    standby_interval: float
    scheduler: type
    align_intervals: bool
    kind: SchedulerKind = LOCAL
    align_anchor: float = 0.0  # seconds since the epoch; see aligned_is_due

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], app_name: str | None = None) -> BeatSettings:
        lock_name = conf.get("redlock_beat_lock_name")
        if lock_name is None:
            lock_name = f"beat:{app_name or 'celery'}"
        elif not isinstance(lock_name, str) or not lock_name:
            raise ConfigError(f"redlock_beat_lock_name must be a non-empty str, got {lock_name!r}")
        ttl = number(
            "redlock_beat_lock_ttl",
            conf.get("redlock_beat_lock_ttl", DEFAULT_LOCK_TTL),
            above=0,
            unit="seconds",
        )
        min_validity = conf.get("redlock_beat_min_validity")
        min_validity = (
            ttl / 3
            if min_validity is None
            else number("redlock_beat_min_validity", min_validity, above=0, unit="seconds")
        )
        # The heartbeat extends every ttl/3, so a healthy leader's validity dips to 2/3 of the TTL.
        if min_validity >= ttl * 2 / 3:
            raise ConfigError(
                f"redlock_beat_min_validity must be below 2/3 of redlock_beat_lock_ttl "
                f"({ttl * 2 / 3:.3g} s), or a healthy leader would refuse to dispatch; "
                f"got {min_validity!r}"
            )
        standby = number(
            "redlock_beat_standby_interval",
            conf.get("redlock_beat_standby_interval", DEFAULT_STANDBY_INTERVAL),
            above=0,
            unit="seconds",
        )
        if standby > ttl:
            raise ConfigError(
                f"redlock_beat_standby_interval ({standby!r} s) must not exceed "
                f"redlock_beat_lock_ttl ({ttl!r} s): failover takes the TTL plus one standby tick"
            )
        scheduler = _scheduler_class(conf.get("redlock_beat_scheduler") or DEFAULT_SCHEDULER)
        state = conf.get("redlock_beat_scheduler_state")
        if state is not None:
            state = choice("redlock_beat_scheduler_state", state, SCHEDULER_STATES)
        kind = scheduler_kind(scheduler, state)
        # Off by default: aligned, an interval no longer means "T after the last run" (a 7-day
        # interval would fire on the anchor's weekday), which nobody should get unasked.
        align = flag("redlock_beat_align_intervals", conf.get("redlock_beat_align_intervals", False))
        anchor = conf.get("redlock_beat_align_anchor")
        anchor = 0.0 if anchor is None else instant("redlock_beat_align_anchor", anchor)
        if align and not kind.aligns:
            raise ConfigError(
                f"redlock_beat_align_intervals = True does not work with {kind.name}: its scheduler "
                "decides which entries are due by itself, so intervals would not be aligned while "
                "slot stamps assumed they were; unset the setting"
            )
        return cls(lock_name, ttl, min_validity, standby, scheduler, align, kind, align_anchor=anchor)


def leader_redlock(conf: Mapping[str, Any]) -> Redlock:
    """A Redlock of the beat's own over the app's ``redlock_*`` settings (masters, timeouts,
    key prefix), so its connections close with the scheduler and never with a task's."""
    refuse_unknown_settings(conf)
    settings = read_settings(conf)
    try:
        return settings.redlock(linger=False)
    except ConfigError as exc:
        raise ConfigError(f"redlock_{exc}") from None


# -- the leader record ---------------------------------------------------------------------------
def read_leader(redlock: Redlock, lock_name: str) -> dict[str, Any] | None:
    """The current leader's record (hostname, pid, since, ...), if a quorum of masters agrees."""
    key = lock_key(redlock.key_prefix, lock_name) + LEADER_SUFFIX
    counts = Counter(v for v in redlock.read_everywhere(key) if v is not None)
    if not counts:
        return None
    value, votes = counts.most_common(1)[0]
    if votes < redlock.quorum:
        return None
    record: dict[str, Any] = json.loads(value)
    return record


class LeaderLock(Lock):
    """The leader lock; each successful extension also refreshes the leader record."""

    def __init__(self, redlock: Redlock, name: str, ttl: float, record: Callable[[], str]) -> None:
        super().__init__(redlock, name, ttl)
        self.record_key = self.key + LEADER_SUFFIX
        self._record = record

    def extended(self, ttl: float) -> None:
        self.announce(ttl)

    def announce(self, ttl: float) -> None:
        # Best effort: the record only informs people, the lock is what decides.
        written = self.redlock.write_everywhere(self.record_key, self._record(), ttl)
        if written < len(self.redlock.masters):
            logger.debug(
                "leader record %s written to %d of %d masters",
                self.record_key,
                written,
                len(self.redlock.masters),
            )


# -- aligned intervals ---------------------------------------------------------------------------
def _alignable(spec: object) -> bool:
    # Only celery's own interval schedule: a subclass with its own is_due keeps its own rule.
    return (
        isinstance(spec, schedule)
        and type(spec).is_due is schedule.is_due
        and not spec.relative
        and spec.seconds > 0
    )


def aligned_is_due(spec: Any, last_run_at: Any, anchor: float = 0.0) -> Any:
    """``schedule.is_due`` with the ticks at ``anchor + k * period`` (``anchor`` in seconds since
    the epoch): due once a boundary has passed since the last run."""
    period = float(spec.seconds)
    now = spec.now().timestamp() - anchor
    last = spec.maybe_make_aware(last_run_at).timestamp() - anchor
    remaining = (math.floor(now / period) + 1) * period - now
    return schedstate(math.floor(now / period) > math.floor(last / period), remaining)


class _AlignedInterval(schedule):  # type: ignore[misc]
    """An interval schedule whose ticks are at ``anchor + k * period`` (see aligned_is_due):
    what an entry with its own is_due is given to ask, for one call."""

    def __init__(self, spec: Any, anchor: float) -> None:
        super().__init__(run_every=spec.run_every, relative=False, nowfun=spec.nowfun, app=spec.app)
        self._anchor = anchor

    def is_due(self, last_run_at: Any) -> Any:
        return aligned_is_due(self, last_run_at, self._anchor)


def _timestamp(spec: Any, value: Any) -> float:
    # A naive datetime is read as celery reads it: in UTC (maybe_make_aware's default).
    aware = spec.maybe_make_aware(value) if hasattr(spec, "maybe_make_aware") else value
    return float(aware.timestamp())


def _estimated_fire(spec: Any, last_run_at: Any, last: float | None, now: float) -> float:
    """The due time a schedule of a kind not known to :func:`intended_fire` fired for, by its
    own ``remaining_estimate`` (how far past due it is now); the send time where that gives
    nothing usable, so that successive sends of the entry still get successive slots."""
    estimate = getattr(spec, "remaining_estimate", None)
    if estimate is not None and last_run_at is not None:
        fire = now + float(estimate(last_run_at).total_seconds())
        if (last is None or fire > last) and fire <= now:
            return fire
    return now


# -- the scheduler --------------------------------------------------------------------------------
_wrapped_classes: dict[type, type] = {}
_wrapped_mutex = threading.Lock()


def _wrap(inner: type) -> type:
    with _wrapped_mutex:
        cls = _wrapped_classes.get(inner)
        if cls is None:
            name = f"Redlock{inner.__name__}"
            cls = type(name, (RedlockScheduler, inner), {"__module__": __name__, "__qualname__": name})
            _wrapped_classes[inner] = cls
        return cls


def _after_fork_in_child() -> None:
    global _wrapped_mutex
    _wrapped_mutex = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_after_fork_in_child)


class RedlockScheduler(Scheduler):  # type: ignore[misc]
    """A beat scheduler that dispatches only while it holds the leader lock.

    Instantiating it builds a class deriving from both this one and the scheduler to wrap
    (``redlock_beat_scheduler``), so the wrapped one keeps its own storage and tick logic; this
    class only decides whether a due entry is sent.
    """

    settings: BeatSettings

    def __new__(cls, app: Any, *args: Any, **kwargs: Any) -> RedlockScheduler:
        if cls is RedlockScheduler:
            settings = BeatSettings.from_conf(app.conf, app.main)
            cls = _wrap(settings.scheduler)
        instance: RedlockScheduler = super().__new__(cls)
        return instance

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        hooks.connect()  # beat publishes: its messages carry the publish time for lock_slot
        self.settings = BeatSettings.from_conf(app.conf, app.main)
        self._redlock = leader_redlock(app.conf)
        self._state = threading.Lock()
        self._lock: LeaderLock | None = None
        self._leading = False
        self._since = 0.0
        self._since_wall = 0.0
        self._hostname = socket.gethostname()
        self._kind = self.settings.kind
        # The entry last reserved and the slot it was found due for (see reserve): the stamp is
        # fixed when the tick is found due, not when the message goes out after the store's write.
        self._stamped: tuple[Any, str | None] | None = None
        super().__init__(app, *args, **kwargs)
        self._kind.adopt(self)

    # -- what celery beat reads ----------------------------------------------------------------------
    @property
    def info(self) -> str:
        s = self.settings
        line = (
            f"    . leader lock -> {lock_key(self._redlock.key_prefix, s.lock_name)} on "
            f"{len(self._redlock.masters)} masters (ttl {s.lock_ttl:g}s, standby tick "
            f"{s.standby_interval:g}s)"
        )
        inner = super().info
        return f"{inner}\n{line}" if inner else line

    @property
    def leading(self) -> bool:
        """Whether this process holds the leader lock now."""
        return self._leading

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._leading and not self._may_dispatch():
            # The heartbeat may only be late; one extension of our own before giving up.
            lock = self._lock
            if lock is None or not (lock.extend() and self._may_dispatch()):
                left = lock.validity if lock is not None else 0.0
                reason = (
                    lock.lost_reason
                    if lock is not None and lock.lost_reason
                    else f"{left:.2f} s of validity left, below redlock_beat_min_validity "
                    f"({self.settings.min_validity:g} s), and the lock could not be extended"
                )
                self._step_down(reason)
        if self._leading:
            delay: float = super().tick(*args, **kwargs)
            return delay
        # A shared store needs no following: it is what the next leader reads.
        delay = self.settings.standby_interval if self._kind.shared else self._follow(*args, **kwargs)
        if self._try_lead():
            return 0.0
        return min(delay, self.settings.standby_interval)

    def setup_schedule(self) -> None:
        # Installing the static entries writes a shared store: left to whoever takes the lead.
        if self._kind.shared and not self._leading:
            return
        super().setup_schedule()

    def reserve(self, entry: Any) -> Any:
        # Celery's tick reserves first and sends after; a shared store's write lies in between
        # and may end in the next slot. The slot is taken now, from the clock the tick was found
        # due by, and the send of this entry uses it (apply_async).
        self._stamped = (entry, self._intended_slot(entry))
        if not self._kind.shared:
            return super().reserve(entry)  # a process-local schedule advances, sent or not
        # A run that is not sent must not be recorded in a shared store, or the next leader
        # would take it as sent; it stays due instead.
        if not self._may_dispatch():
            return entry
        reserved = super().reserve(entry)
        self._kind.reserved(self, reserved)
        # Written now, before the send, as redbeat does by itself (django-celery-beat would write
        # it up to 3 minutes later, or never if it is stopped first): a successor never sends it
        # again. A leader stopped between the two loses that one run; it never doubles it.
        self.sync()
        return reserved

    def sync(self) -> None:
        # A standby has nothing of its own to write (it reserved nothing), and a former leader's
        # unwritten runs were dropped on stepping down; only the leader writes the store.
        if self._kind.shared and not self._leading:
            return
        super().sync()

    def is_due(self, entry: Any) -> Any:
        spec = entry.schedule
        if not (self.settings.align_intervals and _alignable(spec)):
            return super().is_due(entry)
        if type(entry).is_due is ScheduleEntry.is_due:
            return aligned_is_due(spec, entry.last_run_at, self.settings.align_anchor)
        # An entry with checks of its own (django-celery-beat's: enabled, start_time, one_off,
        # expires) keeps them: it is asked as usual, with an aligned stand-in for its schedule
        # for the length of the call, so that only the interval's phase changes.
        entry.schedule = _AlignedInterval(spec, self.settings.align_anchor)
        try:
            return super().is_due(entry)
        finally:
            entry.schedule = spec

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        super().populate_heap(*args, **kwargs)
        if not self.settings.align_intervals or not self._heap:
            return
        # The base class places entries by entry.is_due(), not self.is_due(): re-place the
        # aligned ones, or the first run of each would wait for its unaligned time.
        for index, event in enumerate(self._heap):
            entry = event[2]
            if _alignable(entry.schedule):
                due, delay = self.is_due(entry)
                self._heap[index] = event._replace(time=self._when(entry, 0 if due else delay))
        heapq.heapify(self._heap)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        if not self._may_dispatch():
            self._not_sent(entry)
            return
        super().apply_entry(entry, producer=producer)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        # Checked here too, right before the message goes out: some schedulers call apply_async
        # directly, and time passes between apply_entry and the send.
        if not self._may_dispatch():
            if advance:
                self.reserve(entry)
            self._not_sent(entry)
            return None
        stamped, self._stamped = self._stamped, None
        if advance:
            # Reserved here, not by the base class: it would reserve the entry with the stamp
            # in its options, and a scheduler that stores its entries would store the stamp.
            self.reserve(entry)  # fixes the slot, from last_run_at as it was before this run
            stamped, self._stamped = self._stamped, None
            # The write to a shared store may have outlasted the lock: checked again, so a
            # leader that lost it meanwhile sends nothing (the run is recorded, not doubled).
            if not self._may_dispatch():
                self._not_sent(entry)
                return None
        # Without a reservation of ours (a caller's own apply_async), the slot is taken now.
        ours = stamped is not None and stamped[0] is entry
        slot = stamped[1] if stamped is not None and ours else self._intended_slot(entry)
        if slot is None:
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)
        # The stamp rides in the entry's options for this one send: every wrapped scheduler
        # sends through the base apply_async, which passes the options to the task's apply_async.
        options = entry.options
        entry.options = {**options, "headers": {**(options.get("headers") or {}), SLOT_HEADER: slot}}
        try:
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)
        finally:
            entry.options = options

    def _intended_slot(self, entry: Any) -> str | None:
        """The slot (:data:`SLOT_HEADER`) of the tick ``entry`` is sent for now; None if it
        cannot be known, and the message then goes without it (the worker falls back to the
        publish time) rather than not at all."""
        spec = entry.schedule
        s = self.settings
        try:
            now = _timestamp(spec, spec.now())
            last = None if entry.last_run_at is None else _timestamp(spec, entry.last_run_at)
            anchor = s.align_anchor if s.align_intervals and _alignable(spec) else None
            fire = intended_fire(spec, last, now, anchor=anchor)
            if fire is None:
                fire = _estimated_fire(spec, entry.last_run_at, last, now)
        except Exception:
            logger.warning(
                "%s: the slot it is due for cannot be computed; sent unstamped", entry.name, exc_info=True
            )
            return None
        return render(fire)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._resign()
            self._redlock.close()

    # -- leadership ------------------------------------------------------------------------------------
    def _may_dispatch(self) -> bool:
        lock = self._lock
        return self._leading and lock is not None and lock.validity >= self.settings.min_validity

    def _not_sent(self, entry: Any) -> None:
        if self._leading:
            validity = self._lock.validity if self._lock is not None else 0.0
            logger.warning(
                "%s not sent: the leader lock has %.2f s of validity left, below "
                "redlock_beat_min_validity (%g s)",
                entry.name,
                validity,
                self.settings.min_validity,
            )
        else:
            logger.debug("standby: %s is the leader's to send", entry.name)

    def _follow(self, *args: Any, **kwargs: Any) -> float:
        """Advance the wrapped schedule without sending, as far as it is due now."""
        delay: float = 0.0
        for _ in range(MAX_FOLLOW_STEPS):
            delay = super().tick(*args, **kwargs)
            if delay is None or delay > 0:
                break
        return float(self.max_interval) if delay is None else float(delay)

    def _record(self) -> str:
        return json.dumps(
            {
                "hostname": self._hostname,
                "pid": os.getpid(),
                "since": self._since_wall,
                "lock": lock_key(self._redlock.key_prefix, self.settings.lock_name),
                "ttl": self.settings.lock_ttl,
            }
        )

    def _try_lead(self) -> bool:
        s = self.settings
        # A fresh Lock per attempt: the previous one may still be counting down a handover.
        lock = LeaderLock(self._redlock, s.lock_name, s.lock_ttl, self._record)
        if not lock.acquire(blocking=False):
            return False
        with self._state:
            self._lock = lock
            self._leading = True
            self._since = time.monotonic()
            self._since_wall = time.time()
        process_heartbeat().keep(lock, on_lost=self._on_lost)
        if self._kind.shared and not self._take_over():
            return False
        lock.announce(s.lock_ttl)
        logger.info(
            "beat leader elected: %s pid %d holds %s (validity %.2f s); dispatching",
            self._hostname,
            os.getpid(),
            lock.key,
            lock.validity,
        )
        beat_leader_elected.send(
            sender=self,
            lock_name=s.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            validity=lock.validity,
        )
        return True

    def _take_over(self) -> bool:
        """Set the wrapped scheduler up from its shared store, as it stands now; on failure (the
        store unreachable), give the lock back and stay a standby."""
        try:
            self._kind.forget(self)
            super().setup_schedule()
        except Exception:
            logger.exception(
                "beat: could not read the %s schedule on taking the lead; giving the leader lock back",
                self._kind.name,
            )
            lock = self._leave()
            if lock is not None:
                lock.release()
            return False
        return True

    def _on_lost(self, lock: Lock, reason: str) -> None:
        if lock is self._lock:
            self._step_down(reason)

    def _leave(self) -> LeaderLock | None:
        """Stop leading; the lock that was held, or None if this process was not leading."""
        with self._state:
            if not self._leading:
                return None
            self._leading = False
            lock = self._lock
        if lock is not None:
            process_heartbeat().forget(lock)
        return lock

    def _step_down(self, reason: str) -> None:
        lock = self._leave()
        if lock is None:
            return
        held_for = time.monotonic() - self._since
        # Releasing deletes only our own token, so a successor's lock is never touched.
        lock.release()
        logger.error(
            "beat leader lock %s lost after %.1f s: %s; dispatching stopped, back to standby",
            lock.key,
            held_for,
            reason,
        )
        beat_leader_lost.send(
            sender=self,
            lock_name=self.settings.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            reason=reason,
            held_for=held_for,
        )

    def _resign(self) -> None:
        lock = self._leave()
        if lock is None:
            return
        held_for = time.monotonic() - self._since
        # Cut to min_validity, not deleted: a successor whose clock runs behind ours must not
        # see the slot we just sent as still due.
        handover = self.settings.min_validity
        if not lock.extend(handover):
            lock.release()
        logger.info(
            "beat leader %s pid %d resigned %s after %.1f s; a standby may take over in %.1f s",
            self._hostname,
            os.getpid(),
            lock.key,
            held_for,
            handover,
        )
        beat_leader_lost.send(
            sender=self,
            lock_name=self.settings.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            reason="shut down",
            held_for=held_for,
        )
