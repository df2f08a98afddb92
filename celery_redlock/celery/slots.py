"""Schedule slots: which tick of a periodic schedule a message was published for.

A task with ``lock_slot`` gets the slot appended to its lock name, so every copy of one tick (two
beats sending it, a redelivery) contends for one key while consecutive ticks never do.

The slot comes from the *publish* time, stamped into the message headers by the publishing process
(``before_task_publish``, :data:`PUBLISHED_HEADER`): the time the message is executed varies with
queueing, the time it was sent does not. A message without the header (its publisher does not run
celery_redlock) is placed by its ``eta`` if it has one, else by the worker's clock when the run
starts; see ``RedlockTaskMixin._redlock_unstamped_time`` for what that costs.

The rule, for a message published at wall time ``p`` (seconds since the epoch, UTC):

- **interval** of ``T`` seconds: the epoch-aligned boundary nearest to ``p``, i.e.
  ``round(p / T) * T``. Two sends of one tick land in one slot when both are within ``T/2`` of the
  same boundary. Celery's own interval schedules tick at ``start + k*T``, so two beats started at
  different moments may straddle a half-period; a scheduler that aligns its ticks to the epoch
  (``celery_redlock.beat``) always agrees, and one beat's ticks always map to distinct slots.
- **crontab**: the scheduled fire time nearest to ``p`` (the previous or the next one). Beats send a
  cron tick at (or shortly after) its fire time, so every beat maps it to that fire time.

Slots are rendered as the boundary's UTC ISO 8601 time, e.g. ``report@2026-01-01T10:05:00+00:00``.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from .._validate import number
from ..errors import ConfigError

PUBLISHED_HEADER = "redlock_published"
SLOT_SEPARATOR = "@"


def _utc(timestamp: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc)


def interval_seconds(spec: Any) -> float | None:
    """The period of an interval spec (seconds, timedelta, celery ``schedule``); None for others."""
    from celery.schedules import crontab, schedule

    if isinstance(spec, bool):
        return None
    if isinstance(spec, (int, float)):
        return float(spec)
    if isinstance(spec, dt.timedelta):
        return spec.total_seconds()
    if isinstance(spec, schedule) and not isinstance(spec, crontab):
        return float(spec.run_every.total_seconds())
    return None


def slot_time(spec: Any, published: float) -> dt.datetime:
    """The UTC time of the slot a message published at ``published`` belongs to."""
    from celery.schedules import crontab

    period = interval_seconds(spec)
    if period is not None:
        # An infinite period gives a NaN slot time (0 * inf), which no datetime can hold.
        period = number("lock_slot interval", period, above=0, unit="seconds")
        # floor(x + 0.5): round half up, the same on every machine (round() is banker's rounding).
        return _utc(math.floor(published / period + 0.5) * period)
    if isinstance(spec, crontab):
        return _nearest_cron_fire(spec, published)
    raise ConfigError(
        f"lock_slot must be True (the task's beat_schedule entry), a number of seconds, a "
        f"timedelta, a celery schedule or a crontab; got {spec!r}"
    )


def slot_name(spec: Any, published: float) -> str:
    return slot_time(spec, published).isoformat()


def _cron_zone(cron: Any) -> dt.tzinfo:
    """The time zone a crontab's fields are read in (the app's ``timezone``, UTC by default)."""
    zone = getattr(cron, "tz", None)
    return zone if isinstance(zone, dt.tzinfo) else dt.timezone.utc


def _fires_on(cron: Any, day: dt.date, zone: dt.tzinfo) -> list[dt.datetime]:
    """Every instant (UTC) the crontab fires on local calendar ``day``, in order.

    Computed from the crontab's own field sets, not through celery's ``remaining_delta``, whose
    answers differ between celery releases (5.3 to 5.6 put the next ``*/5`` fire of 10:05 at
    11:00). A wall time that happens twice (the autumn DST change) is two fire times; one that
    never happens (spring) is none.
    """
    if not (
        day.month in cron.month_of_year
        and day.day in cron.day_of_month
        and day.isoweekday() % 7 in cron.day_of_week
    ):  # celery counts Sunday as 0
        return []
    fires = []
    for hour in sorted(cron.hour):
        for minute in sorted(cron.minute):
            for fold in (0, 1):
                local = dt.datetime.combine(day, dt.time(hour, minute, fold=fold), tzinfo=zone)
                instant = local.astimezone(dt.timezone.utc)
                back = instant.astimezone(zone)
                if (back.hour, back.minute) == (hour, minute) and instant not in fires:
                    fires.append(instant)
    return sorted(fires)


def _cron_fire(cron: Any, at: dt.datetime, *, after: bool) -> dt.datetime:
    """The first fire time after ``at`` (``after``), or the last one at or before it."""
    zone = _cron_zone(cron)
    day = at.astimezone(zone).date()
    step = dt.timedelta(days=1 if after else -1)
    # Five years covers every crontab whose day fields can all match in a leap cycle (29
    # February included); one that asks for a weekday *and* a rare date may fire less often
    # than that, and is refused rather than searched for without end.
    for _ in range(5 * 366 + 1):
        fires = _fires_on(cron, day, zone)
        for fire in fires if after else reversed(fires):
            if (fire > at) if after else (fire <= at):
                return fire
        day += step
    raise ConfigError(f"lock_slot: {cron!r} has no fire time within five years of {at.isoformat()}")


def _nearest_cron_fire(cron: Any, published: float) -> dt.datetime:
    at = _utc(published)
    following = _cron_fire(cron, at, after=True)
    previous = _cron_fire(cron, at, after=False)
    return following if (following - at) < (at - previous) else previous
