"""The ``redlock_beat_*`` settings of the HA beat (:mod:`celery_redlock.beat`), read from the
app's configuration and checked once, at start-up: :class:`BeatSettings`.

Each check refuses a value that would make the beat unsafe or useless rather than one that is
merely unusual, and its error names the setting, so ``celery beat`` stops at start naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.beat import Scheduler
from celery.utils.imports import load_extension_class_names, symbol_by_name

from .._validate import choice, flag, instant, number
from ..errors import ConfigError
from .kinds import LOCAL, SCHEDULER_STATES, SchedulerKind, scheduler_kind

DEFAULT_SCHEDULER = "celery.beat:PersistentScheduler"
DEFAULT_LOCK_TTL = 10.0
DEFAULT_STANDBY_INTERVAL = 1.0


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
    # RedlockScheduler says so by this attribute: its module imports this one, so the class
    # cannot be imported here to be compared.
    if getattr(value, "wraps_a_scheduler", False):
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
    align_anchor: float = 0.0  # seconds since the epoch; see aligned.aligned_is_due

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
        # The heartbeat extends every ttl/3 and counts the validity from each extension's start
        # for that interval plus a margin of half of it: about ttl/2 just after an extension,
        # down to ttl/6 before the next. A leader extends once below min_validity (leader.py);
        # at ttl/2 or more, even a fresh extension would leave it below, and a healthy leader
        # would step down.
        if min_validity >= ttl / 2:
            raise ConfigError(
                f"redlock_beat_min_validity must be below half of redlock_beat_lock_ttl "
                f"({ttl / 2:.3g} s), or a healthy leader, whose validity is about that just after "
                f"an extension, would refuse to dispatch; got {min_validity!r}"
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
