"""Slots as pure functions of timestamps: the worker's placement of unstamped messages
(``slot_time``), the beat's stamp (``intended_fire``), and the alignment settings.

DST cases use 2025's changes: Europe/Paris 30 March (02:00 CET -> 03:00 CEST, at 01:00 UTC) and
26 October (03:00 CEST -> 02:00 CET, at 01:00 UTC); America/New_York 9 March (02:00 EST -> 03:00
EDT, at 07:00 UTC) and 2 November (02:00 EDT -> 01:00 EST, at 06:00 UTC).
"""

from __future__ import annotations

import datetime as dt
import math
import types
from collections import Counter
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redlock import ConfigError
from celery_redlock.beat import BeatSettings
from celery_redlock.celery.beat import aligned_is_due
from celery_redlock.celery.slots import (
    PUBLISHED_HEADER,
    SLOT_HEADER,
    intended_fire,
    next_fire,
    previous_fire,
    read_stamp,
    render,
    slot_name,
    slot_time,
)
from celery_redlock.celery.task import RedlockTask

ZONES = ("UTC", "Europe/Paris", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata")
_apps: dict[str, Celery] = {}


def zoned(zone: str) -> Celery:
    """An app whose ``timezone`` is ``zone``: the zone its crontabs are read in."""
    if zone not in _apps:
        app = Celery(f"slots-{zone}", set_as_current=False)
        app.conf.timezone = zone
        _apps[zone] = app
    return _apps[zone]


def cron(zone: str, **fields: Any) -> crontab:
    return crontab(app=zoned(zone), **fields)


def utc(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp()


def slot(spec: Any, text: str) -> str:
    return slot_name(spec, utc(text))


# -- DST: both changes, two zones, an hourly crontab and a daily one inside the changing hour -----
DST_CASES = [
    # zone, crontab fields, a UTC time -> the slot it belongs to
    # Paris, autumn: 02:00 happens twice (00:00 and 01:00 UTC); both are fire times.
    ("Europe/Paris", {"minute": 0}, "2025-10-26T00:00:05", "2025-10-26T00:00:00+00:00"),
    ("Europe/Paris", {"minute": 0}, "2025-10-26T01:00:05", "2025-10-26T01:00:00+00:00"),
    ("Europe/Paris", {"minute": 0}, "2025-10-26T02:00:05", "2025-10-26T02:00:00+00:00"),
    ("Europe/Paris", {"minute": 0}, "2025-10-26T01:59:59", "2025-10-26T01:00:00+00:00"),
    ("Europe/Paris", {"hour": 2, "minute": 30}, "2025-10-26T00:45:00", "2025-10-26T00:30:00+00:00"),
    ("Europe/Paris", {"hour": 2, "minute": 30}, "2025-10-26T01:45:00", "2025-10-26T01:30:00+00:00"),
    ("Europe/Paris", {"hour": 2, "minute": 30}, "2025-10-27T01:00:00", "2025-10-26T01:30:00+00:00"),
    # Paris, spring: 02:00-03:00 never happens; 01:00 CET is 00:00 UTC, 03:00 CEST is 01:00 UTC.
    ("Europe/Paris", {"minute": 0}, "2025-03-30T00:59:59", "2025-03-30T00:00:00+00:00"),
    ("Europe/Paris", {"minute": 0}, "2025-03-30T01:00:05", "2025-03-30T01:00:00+00:00"),
    # A daily 02:30 fires at 03:30 CEST that day (01:30 UTC), as celery's beat sends it.
    ("Europe/Paris", {"hour": 2, "minute": 30}, "2025-03-30T01:30:05", "2025-03-30T01:30:00+00:00"),
    ("Europe/Paris", {"hour": 2, "minute": 30}, "2025-03-30T01:29:55", "2025-03-29T01:30:00+00:00"),
    ("Europe/Paris", {"hour": 2, "minute": 30}, "2025-03-31T00:30:05", "2025-03-31T00:30:00+00:00"),
    # New York, autumn: 01:00 happens twice (05:00 and 06:00 UTC).
    ("America/New_York", {"minute": 0}, "2025-11-02T05:00:05", "2025-11-02T05:00:00+00:00"),
    ("America/New_York", {"minute": 0}, "2025-11-02T06:00:05", "2025-11-02T06:00:00+00:00"),
    ("America/New_York", {"minute": 0}, "2025-11-02T07:00:05", "2025-11-02T07:00:00+00:00"),
    ("America/New_York", {"hour": 1, "minute": 30}, "2025-11-02T05:45:00", "2025-11-02T05:30:00+00:00"),
    ("America/New_York", {"hour": 1, "minute": 30}, "2025-11-02T06:45:00", "2025-11-02T06:30:00+00:00"),
    # New York, spring: 02:00-03:00 never happens; 01:00 EST is 06:00 UTC, 03:00 EDT is 07:00 UTC.
    ("America/New_York", {"minute": 0}, "2025-03-09T06:59:59", "2025-03-09T06:00:00+00:00"),
    ("America/New_York", {"minute": 0}, "2025-03-09T07:00:05", "2025-03-09T07:00:00+00:00"),
    ("America/New_York", {"hour": 2, "minute": 30}, "2025-03-09T07:30:05", "2025-03-09T07:30:00+00:00"),
    ("America/New_York", {"hour": 2, "minute": 30}, "2025-03-10T06:30:05", "2025-03-10T06:30:00+00:00"),
]


@pytest.mark.parametrize(("zone", "fields", "at", "expected"), DST_CASES)
def test_dst_unstamped_slot(zone: str, fields: dict[str, Any], at: str, expected: str) -> None:
    assert slot(cron(zone, **fields), at) == expected


def test_dst_autumn_review_finding_two_real_runs_two_slots() -> None:
    hourly = cron("Europe/Paris", minute=0)
    assert slot(hourly, "2025-10-26T01:00:05") != slot(hourly, "2025-10-26T02:00:05")


@pytest.mark.parametrize("zone", ["Europe/Paris", "America/New_York"])
@pytest.mark.parametrize("day", ["spring", "autumn"])
@pytest.mark.parametrize("fields", [{"minute": 0}, {"hour": 2, "minute": 30}, {"hour": 1, "minute": 30}])
def test_dst_celery_beat_sends_each_get_their_own_stamp_and_unstamped_slot(
    zone: str, day: str, fields: dict[str, Any]
) -> None:
    """Celery's own crontab decides when it is due (its clock stepped 30 s at a time across
    the change); every send gets a stamp of its own, a fire time at or before the send, and an
    unstamped copy published then lands in that same slot."""
    date = {
        ("Europe/Paris", "spring"): "2025-03-30",
        ("Europe/Paris", "autumn"): "2025-10-26",
        ("America/New_York", "spring"): "2025-03-09",
        ("America/New_York", "autumn"): "2025-11-02",
    }[zone, day]
    clock = {"now": 0.0}
    spec = crontab(
        app=zoned(zone), nowfun=lambda: dt.datetime.fromtimestamp(clock["now"], ZoneInfo(zone)), **fields
    )
    t = utc(f"{date}T00:00:00") - 12 * 3600
    last = t
    stamps = []
    while t < utc(f"{date}T00:00:00") + 36 * 3600:
        clock["now"] = t
        due, _ = spec.is_due(dt.datetime.fromtimestamp(last, dt.timezone.utc))
        if due:
            stamp = intended_fire(spec, last, t)
            assert stamp is not None and last < stamp <= t
            assert previous_fire(spec, stamp) == stamp  # a fire time of the schedule
            assert slot_name(spec, t + 5) == render(stamp)
            stamps.append(stamp)
            last = t
        t += 30
    assert stamps and len(set(stamps)) == len(stamps)


# -- late sends -----------------------------------------------------------------------------------
def test_unstamped_send_more_than_half_a_period_late_stays_in_its_slot() -> None:
    hourly = cron("UTC", minute=0)
    assert slot(hourly, "2025-06-01T10:40:00") == "2025-06-01T10:00:00+00:00"
    assert slot(hourly, "2025-06-01T11:00:01") == "2025-06-01T11:00:00+00:00"
    base = 1_700_000_040.0  # a multiple of 60
    assert slot_name(60, base + 45) == render(base) != slot_name(60, base + 60)


def test_stamp_of_a_late_send_is_the_tick_it_was_due_for() -> None:
    hourly = cron("Europe/Paris", minute=0)
    last = utc("2025-06-01T09:00:02")
    # Sent at 10:40, the 10:00 tick: the stamp is 10:00 and 11:00 keeps a slot of its own.
    assert render(intended_fire(hourly, last, utc("2025-06-01T10:40:00")) or 0) == "2025-06-01T10:00:00+00:00"
    following = intended_fire(hourly, utc("2025-06-01T10:40:00"), utc("2025-06-01T11:00:01"))
    assert render(following or 0) == "2025-06-01T11:00:00+00:00"


def test_catch_up_after_a_restart_stamps_the_slot_it_replaces() -> None:
    """Down from 09:30 to 12:40: celery sends the hourly entry once; it stands for 12:00, the
    most recent tick, so a copy of 12:00 sent before the outage ends meets it, and 13:00 is next."""
    hourly = cron("America/New_York", minute=0)
    stamp = intended_fire(hourly, utc("2025-06-01T09:30:00"), utc("2025-06-01T12:40:00"))
    assert render(stamp or 0) == "2025-06-01T12:00:00+00:00"
    assert render(next_fire(hourly, utc("2025-06-01T12:40:00"))) == "2025-06-01T13:00:00+00:00"
    # Intervals: celery's meaning (one period after the last run), or the aligned boundary.
    every = schedule(dt.timedelta(minutes=10))
    assert intended_fire(every, 1000.0, 5000.0) == 1600.0
    assert intended_fire(every, 1000.0, 5000.0, anchor=0.0) == 4800.0
    assert intended_fire(every, 1000.0, 5000.0, anchor=30.0) == 4830.0


def test_celery_early_by_our_reckoning_stamps_the_fire_it_is_early_for() -> None:
    # No fire between the last run and now (celery decided otherwise): the next fire, not the
    # one already sent.
    hourly = cron("UTC", minute=0)
    stamp = intended_fire(hourly, utc("2025-06-01T10:00:01"), utc("2025-06-01T10:59:59"))
    assert render(stamp or 0) == "2025-06-01T11:00:00+00:00"


# -- stamped vs unstamped, as the task reads them ---------------------------------------------------
_task_app = Celery("slots-task", set_as_current=False)


@_task_app.task(base=RedlockTask, lock_slot=60, shared=False, name="slots.job")
def _job() -> None: ...


def worker_slot(headers: dict[str, Any], spec: Any = 60) -> str:
    request = types.SimpleNamespace(headers=headers, eta=None)
    return str(_job._redlock_slot(request, spec))  # type: ignore[attr-defined]


def test_stamp_wins_over_publish_time_and_is_never_recomputed() -> None:
    stamp = "2031-05-06T07:08:09.5+02:00"
    assert (
        worker_slot({SLOT_HEADER: stamp, PUBLISHED_HEADER: 1_700_000_040.0})
        == "2031-05-06T05:08:09.500000+00:00"
    )
    assert worker_slot({PUBLISHED_HEADER: 1_700_000_085.0}) == render(1_700_000_040.0)
    # Unreadable: the publish time instead.
    for bad in ("yesterday", "2031-05-06T07:08:09", 1_700_000_040.0):
        assert worker_slot({SLOT_HEADER: bad, PUBLISHED_HEADER: 1_700_000_085.0}) == render(1_700_000_040.0)
        assert read_stamp(bad) is None


# -- solar ------------------------------------------------------------------------------------------
def test_solar_slots_are_the_event_and_the_same_from_any_moment_after_it() -> None:
    sunrise = solar("sunrise", 48.85, 2.35, app=zoned("UTC"))
    noon = utc("2025-06-01T12:00:00")
    names = {slot_name(sunrise, noon + k * 997.0) for k in range(40)}  # to 23:00
    assert names == {"2025-06-01T03:51:37+00:00"}
    assert render(next_fire(sunrise, noon)) == "2025-06-02T03:50:58+00:00"
    stamp = intended_fire(sunrise, utc("2025-05-31T04:00:00"), utc("2025-06-01T03:52:00"))
    assert render(stamp or 0) == "2025-06-01T03:51:37+00:00"
    # Polar day at 80 N: no sunrise for months; the last one and the next are found.
    polar = solar("sunrise", 80.0, 0.0, app=zoned("UTC"))
    assert render(previous_fire(polar, noon) or 0).startswith("2025-04-")
    assert render(next_fire(polar, noon)).startswith("2025-08-")


# -- alignment: opt-in, to an anchor ---------------------------------------------------------------
def test_alignment_is_off_by_default_and_its_anchor_is_validated() -> None:
    assert BeatSettings.from_conf({}).align_intervals is False
    monday = BeatSettings.from_conf({"redlock_beat_align_anchor": "2024-01-01T00:00:00+00:00"})
    assert monday.align_anchor == utc("2024-01-01T00:00:00")
    aware = dt.datetime(2024, 1, 1, 9, tzinfo=ZoneInfo("Europe/Paris"))
    assert BeatSettings.from_conf({"redlock_beat_align_anchor": aware}).align_anchor == utc(
        "2024-01-01T08:00:00"
    )
    for bad in ("monday", "2024-01-01T00:00:00", dt.datetime(2024, 1, 1), 0, True, 1.5):
        with pytest.raises(ConfigError, match="redlock_beat_align_anchor"):
            BeatSettings.from_conf({"redlock_beat_align_anchor": bad})


def test_a_weekly_interval_aligned_to_a_monday_anchor_fires_on_mondays() -> None:
    week = 7 * 86400.0
    monday = utc("2024-01-01T00:00:00")
    clock = {"now": utc("2025-06-04T12:00:00")}  # a Wednesday
    spec = schedule(
        dt.timedelta(days=7), nowfun=lambda: dt.datetime.fromtimestamp(clock["now"], dt.timezone.utc)
    )
    last = dt.datetime.fromisoformat("2025-06-01T00:00:00+00:00")  # Sunday
    due, _ = aligned_is_due(spec, last, monday)
    assert due  # Monday 2 June has passed since
    fire = intended_fire(spec, last.timestamp(), clock["now"], anchor=monday)
    assert render(fire or 0) == "2025-06-02T00:00:00+00:00"
    assert dt.datetime.fromtimestamp(fire or 0, dt.timezone.utc).weekday() == 0
    # The epoch anchor (1 January 1970, a Thursday) is what the old default gave.
    assert dt.datetime.fromtimestamp(intended_fire(spec, 0.0, clock["now"], anchor=0.0) or 0).weekday() == 3
    assert math.isclose((fire or 0) - monday, 74 * week)


# -- the invariant ----------------------------------------------------------------------------------
MINUTES = st.sampled_from([{0}, {0, 30}, {15}, set(range(0, 60, 5)), {59}])
HOURS = st.sampled_from([set(range(24)), {2}, {1, 2, 3}, {0, 12}, {23}])
DST_DAYS = [
    utc(d)
    for d in (
        "2025-03-09T07:00:00",
        "2025-03-30T01:00:00",
        "2025-10-26T01:00:00",
        "2025-11-02T06:00:00",
        "2025-04-06T15:00:00",
        "2025-10-05T15:30:00",
    )
]
STARTS = st.one_of(
    st.floats(min_value=utc("2020-01-01T00:00:00"), max_value=utc("2030-12-31T00:00:00")),
    st.builds(lambda day, off: day + off, st.sampled_from(DST_DAYS), st.floats(-2 * 86400, 86400)),
)


@st.composite
def schedules(draw: st.DrawFn) -> tuple[Any, float | None]:
    """A schedule and the anchor its beat aligns it to (None: celery's own interval meaning)."""
    kind = draw(st.sampled_from(["interval", "aligned", "crontab"]))
    if kind == "crontab":
        fields = {"minute": draw(MINUTES), "hour": draw(HOURS)}
        return cron(draw(st.sampled_from(ZONES)), **fields), None
    seconds = draw(st.sampled_from([1.0, 30.0, 60.0, 300.0, 3600.0, 86400.0, 7 * 86400.0, 2.5]))
    anchor = draw(st.sampled_from([0.0, utc("2024-01-01T00:00:00"), 17.25])) if kind == "aligned" else None
    return schedule(dt.timedelta(seconds=seconds)), anchor


def due_after(spec: Any, last: float, anchor: float | None) -> float:
    """When a beat finds the entry due again after a run at ``last``."""
    if isinstance(spec, crontab):
        return next_fire(spec, last)
    period = spec.run_every.total_seconds()
    if anchor is None:
        return last + period
    return anchor + (math.floor((last - anchor) / period) + 1) * period


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=schedules(),
    start=STARTS,
    # How late each send is, as a share of the period: on time, a little, more than half, several.
    lateness=st.lists(st.sampled_from([0.0, 0.001, 0.2, 0.49, 0.51, 0.9, 1.5, 3.2]), min_size=2, max_size=6),
)
def test_distinct_fire_times_get_distinct_slots_and_a_stamp_is_its_own_slot(
    plan: tuple[Any, float | None], start: float, lateness: list[float]
) -> None:
    spec, anchor = plan
    last = start
    off_grid = anchor is not None and anchor % spec.run_every.total_seconds() != 0
    stamps: list[float] = []
    unstamped: list[str] = []
    for share in lateness:
        due = due_after(spec, last, anchor)
        period = due_after(spec, due, anchor) - due
        sent = due + share * period
        stamp = intended_fire(spec, last, sent, anchor=anchor)
        assert stamp is not None
        # The stamp is a due time the beat had passed, after the previous run.
        assert last < stamp <= sent
        stamps.append(stamp)
        # A stamped message is exactly its stamp's slot, whatever its publish time or spec.
        text = render(stamp)
        assert worker_slot({SLOT_HEADER: text, PUBLISHED_HEADER: sent + 7.0}, spec) == text
        unstamped.append(worker_slot({PUBLISHED_HEADER: sent}, spec))
        on_epoch_grid = anchor is not None and anchor % period == 0
        if share < 1.0 and (on_epoch_grid or isinstance(spec, crontab)):
            # On a grid the worker knows too (fire times; multiples of the period since the
            # epoch), an unstamped copy sent before the next tick meets the stamped one.
            assert unstamped[-1] == text
        last = sent
    rendered = [render(s) for s in stamps]
    assert len(set(rendered)) == len(rendered)  # distinct intended fire times: distinct slots
    assert stamps == sorted(stamps)
    if not off_grid:
        # Nor do unstamped ones of one beat. (A beat aligned off the epoch grid sends a late tick
        # and the next one less than a period apart, between the same two epoch boundaries: it
        # always stamps, and only its stamps say which tick is which.)
        assert len(set(unstamped)) == len(unstamped)


# -- found by the adversarial review of #15 ------------------------------------------------------
@pytest.mark.timeout(60)
def test_solar_sends_just_after_the_event_get_one_slot_each() -> None:
    """Celery's beat sends a solar entry a few ms after the event. _solar_event rounds the event
    to the second; when that rounds *up* past the send time, previous_fire gives the previous
    day's event, and intended_fire (last run before it) keeps it. Every few days two consecutive
    sunrises are stamped with the same slot, and a lock_slot task drops a real run. The
    worker's fallback (slot_time from the publish time) has the same fault.

    Celery's own solar schedule decides the event and that it is due (its nowfun is the clock)."""
    app = Celery("review15", set_as_current=False)

    def at(now: dt.datetime) -> Any:
        return solar("sunrise", 48.85, 2.35, app=app, nowfun=lambda: now)

    now = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
    last: dt.datetime | None = None
    sends: list[tuple[dt.datetime, dt.datetime, float, dt.datetime]] = []
    for _ in range(30):
        event = now + at(now).remaining_estimate(now)
        send = event + dt.timedelta(milliseconds=20)
        assert at(send).is_due(last or now).is_due
        stamp = intended_fire(at(send), None if last is None else last.timestamp(), send.timestamp())
        assert stamp is not None
        sends.append((event, send, stamp, slot_time(at(send), send.timestamp())))
        last = now = send

    wrong_stamp = [(e.isoformat(), render(st)) for e, _, st, _ in sends if abs(st - e.timestamp()) > 1]
    stamps = Counter(st for _, _, st, _ in sends)
    doubled_stamps = sorted(render(k) for k, n in stamps.items() if n > 1)
    wrong_slot = [
        (e.isoformat(), sl.isoformat()) for e, _, _, sl in sends if abs(sl.timestamp() - e.timestamp()) > 1
    ]
    print(
        f"\nsolar: {len(wrong_stamp)} of 30 stamped, {len(wrong_slot)} of 30 placed (unstamped) "
        "in another day's event"
    )
    assert doubled_stamps == [], f"two sunrises stamped with one slot: {doubled_stamps}"
    assert wrong_stamp == []
    # Unstamped: a send a few ms after the event goes to the previous day's slot, so one sent
    # a second late (its own day) and the next sent on time (the previous day) meet in one.
    assert wrong_slot == []
