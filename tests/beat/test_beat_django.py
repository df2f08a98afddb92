"""RedlockScheduler over django-celery-beat's ``DatabaseScheduler`` on a real PostgreSQL: real
``celery beat`` processes, the 5 real lock masters.

The session creates a database of its own on the PostgreSQL at 127.0.0.1:5432 (trust auth, user
postgres), migrates django-celery-beat into it, and drops it at the end (``pg_database`` in
``conftest.py``). Where nothing answers there, these tests are skipped, unless
``CELERY_REDLOCK_REQUIRE_POSTGRES=1`` (CI) makes that a failure. The test process edits the
schedule through the Django ORM, as the Django admin would. A standby writes nothing to the
database: what the leader sends is what the rows say ran.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from celery_redlock import Redlock

from .conftest import Beats, Records, current_leader, wait_until
from .django_settings import PG_HOST, PG_PORT, PG_USER, celery_settings
from .ha_checks import check_sigkill_failover, check_sigstop, stamp_doubles, stamped_slot
from .test_ha import CONF, PERIOD, SLACK, STANDBY, STEADY_SLOTS, TTL, leader_pid, new_leader

TASK = "tests.beat.beatapp.record"
MAX_LOOP = 1.0  # beat_max_loop_interval of the beats (CeleryBeat's --max-interval)
# What a Django project's settings say (django_settings.py, the README's snippet), test_ha's,
# and intervals aligned to the epoch (what an HA fleet should run), so sends count by slot.
DJANGO_CONF = {**CONF, **celery_settings(), "redlock_beat_align_intervals": True}


def sends_to(records: Records, key: str) -> list[dict[str, Any]]:
    """What the beats published for the entry whose first argument is ``key``."""
    return [json.loads(item) for item in records.client.lrange(f"{key}:sent", 0, -1)]


def agreeing_row(name: str, records: Records) -> Any:
    """The row of entry ``name`` if it counts as many runs as were sent, its last run the last
    send (read twice around the sends, so a send in between only means: not now)."""
    from django_celery_beat.models import PeriodicTask

    row = PeriodicTask.objects.get(name=name)
    sent = records.sent()
    again = PeriodicTask.objects.get(name=name)
    last = max((s["t"] for s in sent), default=None)
    if row.total_run_count != again.total_run_count or row.total_run_count != len(sent) or last is None:
        return None
    return row if abs(row.last_run_at.timestamp() - last) < 0.5 else None


def add_entry(name: str, key: str) -> Any:
    """A PeriodicTask running the recorder every PERIOD seconds, as the admin would add it."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every, _ = IntervalSchedule.objects.get_or_create(every=int(PERIOD), period=IntervalSchedule.SECONDS)
    return PeriodicTask.objects.create(name=name, task=TASK, interval=every, args=json.dumps([key]))


@pytest.mark.timeout(90)
def test_three_beats_over_django_send_each_slot_once(
    django_beats: Beats, records: Records, redlock: Redlock
) -> None:
    # beat_scheduler comes from the settings; one names the wrapped one by its alias, "django".
    django_beats.start(2, conf=DJANGO_CONF)
    django_beats.start(1, conf={**DJANGO_CONF, "redlock_beat_scheduler": "django"})
    first = int(time.time() // PERIOD) + 2
    last = first + STEADY_SLOTS - 1

    def stamped_after_last() -> bool:
        return any((stamped_slot(s) or 0) > last for s in records.sent())

    wait_until(stamped_after_last, 50, f"slot {last + 1} to be sent")
    # Only the sender writes the row: a standby's bookkeeping would count runs nobody sent (and
    # push last_run_at on). Read while the beats run (a beat stopped between recording a run and
    # sending it would make the two differ by one).
    row = wait_until(lambda: agreeing_row("job", records), 5, "the row to agree with the sends")
    for beat in django_beats.procs:
        beat.stop()

    sent = records.sent()
    # Counted by the slot each send was stamped for, never by when it went out: a send a loaded
    # machine made late, in the next period, is still its own slot's.
    window = [s for s in sent if first <= (stamped_slot(s) or 0) <= last]
    missed = sorted(set(range(first, last + 1)) - {stamped_slot(s) for s in window})
    doubled = stamp_doubles(window)
    senders = {s["pid"] for s in window}
    print(
        f"\n[beat] django-celery-beat, 3 beats, {STEADY_SLOTS} slots: {len(window)} sent, "
        f"doubled {len(doubled)}, missed {len(missed)}; "
        f"the row agreed with the sends ({row.total_run_count} runs)"
    )
    assert [s for s in sent if stamped_slot(s) is None] == []
    assert doubled == [] and missed == []
    assert len(senders) == 1, f"more than one beat dispatched: {senders}"


@pytest.mark.timeout(60)
def test_sigkill_leader_over_django(django_beats: Beats, records: Records, redlock: Redlock) -> None:
    django_beats.start(2, conf=DJANGO_CONF)
    # Exactly once per slot stamp: the store has each run written before it is sent, so a new
    # leader never sends again what the dead one sent (it may lose the one run it was sending).
    check_sigkill_failover(django_beats, records, redlock, "django-celery-beat", stamp_doubles)


@pytest.mark.timeout(60)
def test_sigstopped_leader_over_django(django_beats: Beats, records: Records, redlock: Redlock) -> None:
    django_beats.start(2, conf=DJANGO_CONF)
    check_sigstop(django_beats, records, redlock, "django-celery-beat", stamp_doubles)


@pytest.mark.timeout(90)
def test_entries_added_changed_disabled_through_the_orm(
    django_beats: Beats, records: Records, redlock: Redlock
) -> None:
    """Each edit is honoured within one beat_max_loop_interval (then the entry's next slot),
    before and after a failover."""
    first_key, changed_key, other_key = (f"{records.key}-{suffix}" for suffix in ("a", "b", "c"))
    seen = MAX_LOOP + SLACK  # an edit shows at the leader's next read of the schedule
    bound = seen + PERIOD  # and an entry then runs at its next slot
    django_beats.start(2, conf=DJANGO_CONF, schedule={})
    first_leader = leader_pid(redlock, django_beats)

    added_at = time.time()
    task = add_entry("x", first_key)
    wait_until(lambda: sends_to(records, first_key), 10, "the added entry to be sent")
    added_latency = sends_to(records, first_key)[0]["t"] - added_at

    changed_at = time.time()
    task.args = json.dumps([changed_key])
    task.save()
    wait_until(lambda: sends_to(records, changed_key), 10, "the changed entry to be sent")
    changed_latency = sends_to(records, changed_key)[0]["t"] - changed_at

    # Whoever leads next reads the schedule as it stands.
    django_beats.by_pid(first_leader).kill()
    second_leader, _ = new_leader(redlock, first_leader, timeout=15)
    wait_until(
        lambda: [s for s in sends_to(records, changed_key) if s["pid"] == second_leader],
        10,
        "the new leader to send the changed entry",
    )
    added2_at = time.time()
    add_entry("y", other_key)
    wait_until(lambda: sends_to(records, other_key), 10, "the second added entry to be sent")
    added2_latency = sends_to(records, other_key)[0]["t"] - added2_at

    disabled_at = time.time()
    task.enabled = False
    task.save()
    settled = disabled_at + seen
    wait_until(
        lambda: len([s for s in sends_to(records, other_key) if s["t"] > settled]) >= 3,
        15,
        "three more sends of the other entry",
    )

    late_first = [s for s in sends_to(records, first_key) if s["t"] > changed_at + seen]
    late_changed = [s for s in sends_to(records, changed_key) if s["t"] > settled]
    # The store records each run before it is sent: no stamp twice, even across the failover.
    doubled = {k: stamp_doubles(sends_to(records, k)) for k in (first_key, changed_key, other_key)}
    print(
        f"\n[beat] django-celery-beat ORM edits: added sent after {added_latency:.2f} s, changed after "
        f"{changed_latency:.2f} s, added after failover {added2_latency:.2f} s (bound {bound:.1f} s); "
        f"sent after being changed {len(late_first)}, after being disabled {len(late_changed)}"
    )
    assert added_latency <= bound and changed_latency <= bound and added2_latency <= bound
    assert late_first == [] and late_changed == []
    assert all(v == [] for v in doubled.values()), doubled
    assert {s["pid"] for s in sends_to(records, other_key)} == {second_leader}


@pytest.mark.timeout(60)
def test_aligned_intervals_keep_the_entrys_own_checks(
    django_beats: Beats, records: Records, redlock: Redlock
) -> None:
    """With redlock_beat_align_intervals, a django-celery-beat entry still answers for its own
    rules: a one-off entry runs once, and an entry whose start_time is ahead waits for it."""
    from django_celery_beat.models import PeriodicTask

    once_key, later_key = f"{records.key}-once", f"{records.key}-later"
    django_beats.start(2, conf=DJANGO_CONF, schedule={})
    once = add_entry("once", once_key)
    once.one_off = True
    once.save()
    later = add_entry("later", later_key)
    starts_at = time.time() + 4 * PERIOD
    later.start_time = datetime.datetime.fromtimestamp(starts_at, tz=datetime.timezone.utc)
    later.save()
    wait_until(lambda: sends_to(records, once_key), 10, "the one-off entry to be sent")
    wait_until(lambda: sends_to(records, later_key), 15, "the entry with a start time to be sent")
    # Four more periods: a one-off entry aligned without its own checks would run every period.
    time.sleep(4 * PERIOD)  # an observation window, not a synchronisation
    assert len(sends_to(records, once_key)) == 1, sends_to(records, once_key)
    assert min(s["t"] for s in sends_to(records, later_key)) >= starts_at - 0.05
    assert not PeriodicTask.objects.get(name="once").enabled  # django-celery-beat's own bookkeeping


# -- found by the adversarial review of #15 ------------------------------------------------------
def _stamps(sent: list[dict[str, Any]]) -> list[str]:
    return [s["slot"] for s in sorted(sent, key=lambda s: s["t"])]


def _sending_leader(redlock: Redlock, records: Records, timeout: float) -> int:
    """The pid the leader record names, once that beat has sent something. Read afresh at each
    poll: the lead may have moved since it was last read (to the standby just started, say), and
    waiting for sends from a beat that no longer leads would wait in vain."""

    def sending() -> int | None:
        record = current_leader(redlock)
        pid = int(record["pid"]) if record else None
        return pid if pid is not None and records.sent_by(pid) else None

    pid: int = wait_until(sending, timeout, "a send from the beat the leader record names")
    return pid


# Where in its slot a new leader's first tick must block on the row for the test's premise: late
# enough that its second send follows at once when the write ends past the boundary (with the
# bug planted, a tick blocked at phase 0.08 sent its next a slot later and doubled nothing). A
# take-over lands at a phase set by when the old lock expired and by the standby's ticks, which
# the test does not steer: about a third land here (2 of 8 seen, and 1 of 3).
TAKEOVER_PHASES = (0.55, 0.9)
# How long take-overs are repeated for the premise: some 30 of them (4.5 s each seen), which all
# miss it with odds under 1e-5; the test's timeout (240 s) leaves room for the rest.
TAKEOVERS_WITHIN = 150.0


def _periodic_task(name: str, key: str) -> Any:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every, _ = IntervalSchedule.objects.get_or_create(every=int(PERIOD), period=IntervalSchedule.SECONDS)
    return PeriodicTask.objects.create(
        name=name, task="tests.beat.beatapp.record", interval=every, args=f'["{key}"]'
    )


@pytest.mark.timeout(240)
def test_django_takeover_tick_whose_write_crosses_a_boundary_keeps_its_own_slot_stamp(
    django_beats: Beats,
    records: Records,
    redlock: Redlock,
    pg_database: str,
) -> None:
    """A tick found due in slot k is stamped k, however long the write before its send takes.

    RedlockScheduler._intended_slot computes an aligned stamp as the boundary at or before the
    clock *when the message goes out*; over django-celery-beat the run is first written to
    PostgreSQL (reserve -> sync), and the is_due decision came before that. A new leader's first
    tick lands at any phase of a slot; when its write ends past the next boundary, the tick of
    slot k goes out stamped k+1, and the entry (last run: in slot k) is due again at once and
    sent stamped k+1 too: two messages, one stamp, and a lock_slot task drops a real run. (The
    flake of test_sigstopped_leader_over_django: two sends stamped 17:13:36, 19 ms apart, by
    the new leader right after it took over at 17:13:35.983.) Here a row lock held by another
    session (an admin's open transaction) stretches the write; the take-over is repeated until
    the new leader's tick lands late enough in its slot for the second send to follow at once
    (``TAKEOVER_PHASES``; about a third of take-overs do), for up to ``TAKEOVERS_WITHIN``.
    """
    django_beats.start(2, conf=DJANGO_CONF, schedule={})
    _periodic_task("job", records.key)
    admin = psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=pg_database, autocommit=True, connect_timeout=5
    )

    def leader_waits_on_the_row() -> bool:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            (pg_database,),
        ).fetchone()
        return bool(row and row[0])

    phases: list[float] = []
    deadline = time.monotonic() + TAKEOVERS_WITHIN
    try:
        while True:
            leader = _sending_leader(redlock, records, timeout=25)
            holder = psycopg.connect(
                host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=pg_database, connect_timeout=5
            )
            try:
                with holder.transaction():
                    django_beats.by_pid(leader).kill()
                    holder.execute(
                        "SELECT id FROM django_celery_beat_periodictask WHERE name = 'job' FOR UPDATE"
                    )
                    leader, _ = new_leader(redlock, leader, timeout=TTL + STANDBY + 10)
                    wait_until(leader_waits_on_the_row, 5, "the new leader's write to wait on the row")
                    blocked_at = time.time()
                    phase = blocked_at - math.floor(blocked_at)
                    phases.append(round(phase, 2))
                    lucky = TAKEOVER_PHASES[0] <= phase <= TAKEOVER_PHASES[1]
                    if lucky:  # hold it until just past the next boundary
                        boundary = math.floor(blocked_at) + 1.05
                        wait_until(lambda b=boundary: time.time() > b, 2, "the next boundary")
                released_at = time.time()
            finally:
                holder.close()
            if lucky:
                break
            # The premise is not met yet: that is the set-up's luck, not a finding. It is made
            # again until it is, and only a deadline passed without it fails (never a skip).
            assert time.monotonic() < deadline, (
                f"no take-over landed in phases {TAKEOVER_PHASES} of its slot within "
                f"{TAKEOVERS_WITHIN:g} s; phases seen: {phases}"
            )
            django_beats.start(1, conf=DJANGO_CONF, schedule={})  # a standby for the next round
        wait_until(lambda: len(records.sent_by(leader)) >= 4, 10, "4 sends of the new leader")
    finally:
        admin.close()
    for beat in django_beats.procs:
        beat.stop()
    stamps = _stamps(records.sent_by(leader))
    doubled = sorted(k for k, n in Counter(stamps).items() if n > 1)
    print(f"\nnew leader blocked at phase {phase:.2f}, released at {released_at:.3f}; stamps {stamps}")
    assert doubled == [], f"one stamp on two messages: {doubled} (stamps {stamps})"
