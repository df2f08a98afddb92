"""Schedule slots: which tick of a periodic schedule a message was sent for.

A task with ``lock_slot`` gets the slot appended to its lock name, so every copy of one tick (two
beats sending it, a redelivery) contends for one key while consecutive ticks never do. Slots are
rendered as a UTC ISO 8601 instant, e.g. ``report@2026-01-01T10:05:00+00:00``.

Where the slot comes from, best first:

1. **The beat's stamp** (:data:`SLOT_HEADER`, ``redlock_slot``). ``RedlockScheduler`` knows the
   entry it fires and the due time it fires it for, and writes that instant into the message
   (:func:`intended_fire`). The worker takes it as it is and computes nothing: a stamped message
   belongs to exactly the slot of its stamp, however late it was sent or run, in any time zone.
2. **The publish time** (:data:`PUBLISHED_HEADER`, stamped by our ``before_task_publish`` hook in
   any publishing process that runs celery_redlock, such as a plain ``PersistentScheduler`` beat),
   placed on the schedule by :func:`slot_time`.
3. A message with neither (its publisher does not run celery_redlock) is placed by its ``eta``
   if it has one, else by the worker's clock when the run starts; see
   ``RedlockTaskMixin._redlock_unstamped_time``.

The rule for an unstamped message published at wall time ``p`` is the **last** slot that had
begun by ``p``: a beat sends a tick at or after its due time, never before (the same clock decides
that the tick is due and stamps ``p``), so ``p`` lies at or after its own slot. Concretely:

- **interval** of ``T`` seconds: ``floor(p / T) * T``, boundaries at multiples of ``T`` since the
  epoch.
- **crontab**: the last fire time at or before ``p``, in the crontab's time zone. A local time that
  happens twice (autumn DST change) is two fire times, one hour apart; one that never happens
  (spring) fires at the same instant a clock that skipped it reads as that time (02:30 in a
  skipped hour fires at 03:30 new time), which is when celery's beat sends it.
- **solar**: the last occurrence of the event at or before ``p``, at the observer's position.

What the publish time cannot tell, and only the stamp fixes:

- A message sent more than a whole period late (a beat catching up after a restart) is placed in
  the slot in progress when it was sent, not the one it was due for. The next tick still gets a
  slot of its own, but two copies of one late tick, sent either side of a boundary, do not meet.
- Celery's own interval schedules tick ``T`` after the previous run, not on epoch boundaries:
  two plain beats tick at unrelated phases, so copies of "one tick" from the two arrive up to a
  period apart, in one slot per boundary interval. With ``lock_release="on_expiry"`` the
  lock must then outlive the run by that much: a ``lock_ttl`` of about one period (each slot has
  a key of its own, so a longer TTL never blocks the next tick).
- Sends of one plain beat less than a period apart (Celery's interval measures from the moment a
  run was *reserved*; a slow publish followed by a fast one) can fall between the same two
  boundaries: the second is then taken for a copy of the first.
- A message sent *before* its fire time (by hand, ``apply_async`` rather than a beat) belongs to
  the slot before.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from .._validate import number
from ..errors import ConfigError

#: The intended slot, written by ``RedlockScheduler`` into every message it sends: the due time
#: the entry fired for, as an ISO 8601 UTC instant (``2026-03-29T01:30:00+00:00``).
SLOT_HEADER = "redlock_slot"
#: The publish time (seconds since the epoch), written by our ``before_task_publish`` hook.
PUBLISHED_HEADER = "redlock_published"
SLOT_SEPARATOR = "@"

# Solar events come out of an iterative search whose last digits depend on where it started
# (about 25 ms apart for two starts a few hours apart): each event is searched again from a
# start fixed by a coarse grid, and the slot is rounded to the second.
_SOLAR_GRID = 600.0
_SOLAR_LEAD = 1800.0
# ephem gives up on an event the sun does not reach today (polar day or night); the search
# steps a day at a time, for at most a year, as celery's own solar schedule does.
_SOLAR_DAYS = 366
# Celery's beat sends a solar entry at or just after *its* event, which may be up to about a
# second earlier than ours (ours is rounded to the second, and the searches differ by tens of
# ms): a time is attributed to an event of ours up to this much after it. A solar schedule's
# events are hours apart, so this never reaches the next one.
_SOLAR_TOLERANCE = 60.0


def _utc(timestamp: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc)


def render(instant: float) -> str:
    """A slot's text: the UTC ISO 8601 form of ``instant`` (seconds since the epoch)."""
    return _utc(instant).isoformat()


def read_stamp(value: object) -> str | None:
    """The slot a :data:`SLOT_HEADER` value names, in canonical form; None if it names none
    (not a string, not ISO 8601, or a local time without its UTC offset)."""
    if not isinstance(value, str):
        return None
    try:
        instant = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    if instant.tzinfo is None or instant.utcoffset() is None:
        return None
    return instant.astimezone(dt.timezone.utc).isoformat()


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


def _is_solar(spec: Any) -> bool:
    from celery.schedules import solar

    return isinstance(spec, solar)


def slot_time(spec: Any, published: float) -> dt.datetime:
    """The UTC time of the slot an unstamped message published at ``published`` belongs to."""
    from celery.schedules import crontab

    period = interval_seconds(spec)
    if period is not None:
        # An infinite period gives a NaN slot time (0 * inf), which no datetime can hold.
        period = number("lock_slot interval", period, above=0, unit="seconds")
        return _utc(math.floor(published / period) * period)
    if isinstance(spec, crontab) or _is_solar(spec):
        fire = previous_fire(spec, published)
        if fire is None:
            raise ConfigError(f"lock_slot: {spec!r} has no fire time before {render(published)}")
        return _utc(fire)
    raise ConfigError(
        f"lock_slot must be True (the task's beat_schedule entry), a number of seconds, a "
        f"timedelta, a celery schedule, a crontab or a solar schedule; got {spec!r}"
    )


def slot_name(spec: Any, published: float) -> str:
    return slot_time(spec, published).isoformat()


def slot_period(spec: Any, at: float) -> float:
    """The length of the slot that follows ``at`` (the period of an interval; the gap between
    the next two fire times of a crontab or solar schedule)."""
    period = interval_seconds(spec)
    if period is not None:
        return period
    following = next_fire(spec, at)
    return next_fire(spec, following) - following


# -- the beat's side ------------------------------------------------------------------------------
def intended_fire(
    spec: Any, last_run_at: float | None, now: float, *, anchor: float | None = None
) -> float | None:
    """The due time (seconds since the epoch) of the tick a beat sends at ``now`` for an entry
    last run at ``last_run_at``; None for a schedule of a kind not known here.

    - An interval the beat aligns (``anchor`` given): the last boundary ``anchor + k*T`` at or
      before ``now``, the one its aligned ``is_due`` found passed.
    - Any other celery interval: ``last_run_at + T``, when celery's ``is_due`` found it due.
      (A ``relative=True`` interval rounds that time in ways that changed between celery
      releases: not known here.)
    - crontab and solar: the last fire time at or before ``now``, so a beat catching up after
      a restart stamps the slot it replaces, and the next fire stays a slot of its own. Should
      no fire lie between the last run and ``now`` (celery decided otherwise, as some releases
      do around DST changes), the first fire after the last run: this send is for that one.
    """
    from celery.schedules import crontab, schedule

    if isinstance(spec, crontab) or _is_solar(spec):
        fire = previous_fire(spec, now)
        if last_run_at is not None and (fire is None or fire <= last_run_at):
            fire = next_fire(spec, last_run_at)
        return fire
    if isinstance(spec, schedule) and type(spec).is_due is schedule.is_due and not spec.relative:
        period = float(spec.run_every.total_seconds())
        if anchor is not None:
            return anchor + math.floor((now - anchor) / period) * period
        # Never run (a store that keeps no first run time): due from the moment it was found.
        return now if last_run_at is None else last_run_at + period
    return None


# -- fire times of crontab and solar schedules ----------------------------------------------------
def previous_fire(spec: Any, at: float) -> float | None:
    """The last fire time of a crontab or solar ``spec`` at or before ``at`` (for solar, up to
    ``_SOLAR_TOLERANCE`` after it); None if none is found (a solar event the sun has not reached
    for a year)."""
    if _is_solar(spec):
        return _solar_event(spec, at + _SOLAR_TOLERANCE, after=False)
    return _cron_fire(spec, _utc(at), after=False).timestamp()


def next_fire(spec: Any, at: float) -> float:
    """The first fire time of a crontab or solar ``spec`` after ``at``."""
    if _is_solar(spec):
        event = _solar_event(spec, at, after=True)
        if event is None:
            raise ConfigError(f"lock_slot: {spec!r} does not happen within a year of {render(at)}")
        return event
    return _cron_fire(spec, _utc(at), after=True).timestamp()


def _cron_zone(cron: Any) -> dt.tzinfo:
    """The time zone a crontab's fields are read in (the app's ``timezone``, UTC by default)."""
    zone = getattr(cron, "tz", None)
    return zone if isinstance(zone, dt.tzinfo) else dt.timezone.utc


def _fires_on(cron: Any, day: dt.date, zone: dt.tzinfo) -> list[dt.datetime]:
    """Every instant (UTC) the crontab fires on local calendar ``day``, in order.

    Computed from the crontab's own field sets, not through celery's ``remaining_delta``, whose
    answers differ between celery releases (5.3 to 5.6 put the next ``*/5`` fire of 10:05 at
    11:00). A wall time that happens twice (the autumn DST change) is two fire times: read
    literally, the schedule asks for both. One that never happens (spring) is the instant it
    names read with the offset in force before the change (``fold=0``), i.e. as far past the
    change as it was past the last valid time: where cron runs a skipped job and celery's beat
    sends it. It may coincide with a real fire time (hourly: 02:00 skipped is 03:00), and is then
    that one fire, not two.
    """
    if not (
        day.month in cron.month_of_year
        and day.day in cron.day_of_month
        and day.isoweekday() % 7 in cron.day_of_week
    ):  # celery counts Sunday as 0
        return []
    fires: set[dt.datetime] = set()
    for hour in cron.hour:
        for minute in cron.minute:
            for fold in (0, 1):
                local = dt.datetime.combine(day, dt.time(hour, minute, fold=fold), tzinfo=zone)
                instant = local.astimezone(dt.timezone.utc)
                back = instant.astimezone(zone)
                exists = (back.hour, back.minute) == (hour, minute)
                if exists or fold == 0:
                    fires.add(instant)
    return sorted(fires)


def _cron_fire(cron: Any, at: dt.datetime, *, after: bool) -> dt.datetime:
    """The first fire time after ``at`` (``after``), or the last one at or before it."""
    zone = _cron_zone(cron)
    step = dt.timedelta(days=1 if after else -1)
    # A skipped local time can fire on the next local day (a zone that skips 23:00-24:00), so
    # the search starts one day before ``at``'s day (after it, going back) and looks at one day
    # more once it has found a fire.
    day = at.astimezone(zone).date() - step
    best: dt.datetime | None = None
    # Five years covers every crontab whose day fields can all match in a leap cycle (29
    # February included); one that asks for a weekday *and* a rare date may fire less often
    # than that, and is refused rather than searched for without end.
    for _ in range(5 * 366 + 3):
        found_before = best is not None
        for fire in _fires_on(cron, day, zone):
            # The nearest to ``at`` on its side: the earliest after it, the latest before.
            if (fire > at if after else fire <= at) and (best is None or (fire < best) == after):
                best = fire
        if found_before and best is not None:
            return best
        day += step
    if best is not None:
        return best
    raise ConfigError(f"lock_slot: {cron!r} has no fire time within five years of {at.isoformat()}")


def _solar_event(spec: Any, at: float, *, after: bool) -> float | None:
    """The first occurrence of a celery ``solar`` event after ``at``, or the last at or before
    it, to the second; None if the sun does not reach it within a year.

    The observer, the method (rising, setting, transit) and ``use_center`` are the schedule's
    own, so the event is the one celery's beat waits for.
    """
    import ephem

    def search(start: float, forward: bool) -> float | None:
        observer = spec.cal.copy()  # the schedule's own observer is changed by celery's calls
        method = spec.method if forward else spec.method.replace("next_", "previous_", 1)
        skip = observer.next_antitransit if forward else observer.previous_antitransit
        kwargs = {"use_center": True} if spec.use_center else {}
        sun = ephem.Sun()
        when = ephem.Date(_utc(start).replace(tzinfo=None))
        for _ in range(_SOLAR_DAYS):
            try:
                event = getattr(observer, method)(sun, start=when, **kwargs)
            except ephem.CircumpolarError:
                when = skip(sun, start=when)
                continue
            return float(event.datetime().replace(tzinfo=dt.timezone.utc).timestamp())
        return None

    rough = search(at, after)
    if rough is None:
        return None
    # Search again forward from a start fixed by the grid, never by ``at``: every copy of one
    # tick then gets the same digits, whatever moment it was computed from.
    start = math.floor((rough - _SOLAR_LEAD) / _SOLAR_GRID) * _SOLAR_GRID
    event = search(start, True)
    if event is None:
        return None
    event = float(math.floor(event + 0.5))
    # Rounding may carry an event to just past ``at``: it is then the neighbour asked for.
    if after and event <= at:
        return _solar_event(spec, rough + 1.0, after=True)
    if not after and event > at:
        return _solar_event(spec, rough - 1.0, after=False)
    return event
