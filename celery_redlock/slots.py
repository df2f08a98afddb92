"""Schedule slots: which tick of a periodic schedule a message was published for.

A task with ``lock_slot`` gets the slot appended to its lock name, so every copy of one tick (two
beats sending it, a redelivery) contends for one key while consecutive ticks never do.

The slot comes from the *publish* time, stamped into the message headers by the publishing process
(``before_task_publish``, :data:`PUBLISHED_HEADER`): the time the message is executed varies with
queueing, the time it was sent does not.

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

from .errors import ConfigError

PUBLISHED_HEADER = "redlock_published"
SLOT_SEPARATOR = "@"

# How far back to look for the previous cron fire time, widening until one is found.
_CRON_LOOKBACK = (60.0, 3600.0, 86400.0, 7 * 86400.0, 32 * 86400.0, 367 * 86400.0, 5 * 367 * 86400.0)


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
        if not period > 0:
            raise ConfigError(f"lock_slot interval must be > 0 seconds, got {spec!r}")
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


def _next_fire(cron: Any, after: dt.datetime) -> dt.datetime:
    last, delta, _ = cron.remaining_delta(after)
    fire: dt.datetime = last + delta
    return fire.astimezone(dt.timezone.utc)


def _nearest_cron_fire(cron: Any, published: float) -> dt.datetime:
    at = _utc(published)
    following = _next_fire(cron, at)
    previous: dt.datetime | None = None
    for lookback in _CRON_LOOKBACK:
        candidate = _next_fire(cron, at - dt.timedelta(seconds=lookback))
        if candidate <= at:
            # Walk forward to the last fire time at or before ``at``.
            while True:
                after = _next_fire(cron, candidate)
                if after > at:
                    break
                candidate = after
            previous = candidate
            break
    if previous is None or (following - at) < (at - previous):
        return following
    return previous
