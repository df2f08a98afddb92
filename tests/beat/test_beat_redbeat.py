"""RedlockScheduler over celery-redbeat's ``RedBeatScheduler``: real ``celery beat`` processes, a
real Redis for redbeat's schedule (a server of these tests' own), the 5 real lock masters.

redbeat keeps the whole schedule in Redis and its own lock is left off (RedlockScheduler turns it
off; none of these tests sets ``redbeat_lock_key``). A standby writes nothing to redbeat's keys:
what the leader sends is what redbeat's records say ran. redbeat's intervals count from the
previous run (they are not aligned to the epoch), so one period sent twice shows as two sends
closer than half a period.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import schedule
from redbeat import RedBeatSchedulerEntry
from redbeat.schedulers import ensure_conf

from celery_redlock import Redlock
from celery_redlock.testing import RedisServer

from . import redbeat_config
from .conftest import Beats, Records, wait_until
from .ha_checks import (
    check_sigkill_failover,
    check_sigstop,
    interval_doubles,
    interval_gaps,
)
from .test_ha import (
    CONF,
    PERIOD,
    SCHEDULER,
    SLACK,
    STANDBY,
    STEADY_SLOTS,
    TTL,
    leader_pid,
    new_leader,
    wait_sends,
)

TASK = "tests.beat.beatapp.record"
MAX_LOOP = 1.0  # beat_max_loop_interval of the beats (CeleryBeat's --max-interval)


@pytest.fixture
def redbeat_conf(redbeat_redis: RedisServer, records: Records) -> dict[str, Any]:
    """Settings of the beats: the README's (redbeat_config.py) over this test's Redis, redbeat's
    keys under a prefix of this test's own."""
    return {
        **CONF,
        **redbeat_config.settings(),
        "redbeat_redis_url": redbeat_redis.url,
        "redbeat_key_prefix": f"redbeat:{records.key}:",
        "redlock_beat_align_intervals": False,  # refused with redbeat (test_settings.py)
    }


@pytest.fixture
def redbeat_app(redbeat_conf: dict[str, Any]) -> Iterator[Celery]:
    """An app in the test process for redbeat's entry API, over the beats' redbeat keys."""
    app = Celery("beattests", set_as_current=False)
    app.conf.update(
        redbeat_redis_url=redbeat_conf["redbeat_redis_url"],
        redbeat_key_prefix=redbeat_conf["redbeat_key_prefix"],
    )
    ensure_conf(app)
    yield app
    client = getattr(app, "redbeat_redis", None)
    if client is not None:
        client.close()


def sends_to(records: Records, key: str) -> list[dict[str, Any]]:
    """What the beats published for the entry whose first argument is ``key``."""
    import json

    return [json.loads(item) for item in records.client.lrange(f"{key}:sent", 0, -1)]


def stored(app: Celery, name: str) -> RedBeatSchedulerEntry:
    """Entry ``name`` as redbeat has it in Redis now."""
    return RedBeatSchedulerEntry.from_key(app.redbeat_conf.key_prefix + name, app=app)


def run_count(app: Celery, name: str) -> int:
    """redbeat's own record of how often entry ``name`` ran."""
    return int(stored(app, name).total_run_count or 0)


@pytest.mark.timeout(90)
def test_three_beats_over_redbeat_send_each_period_once(
    beats: Beats, records: Records, redlock: Redlock, redbeat_conf: dict[str, Any], redbeat_app: Celery
) -> None:
    # beat_scheduler comes from the settings; one chooses it on the command line instead.
    beats.start(2, conf=redbeat_conf)
    beats.start(1, conf={k: v for k, v in redbeat_conf.items() if k != "beat_scheduler"}, scheduler=SCHEDULER)
    wait_until(lambda: len(records.sent()) >= STEADY_SLOTS + 2, 50, f"{STEADY_SLOTS + 2} sends")
    # Only the sender writes redbeat's run records: a standby advancing them would count runs
    # nobody sent (and the leader would find nothing due). Read while the beats run (a beat
    # stopped between recording a run and sending it would make the two differ by one).
    ran = wait_until(
        lambda: (count := run_count(redbeat_app, "job")) == len(records.sent()) and count,
        5,
        "the counts to agree",
    )
    for beat in beats.procs:
        beat.stop()

    sent = records.sent()
    window = sorted(sent, key=lambda s: s["t"])[1 : STEADY_SLOTS + 2]  # from the second send
    gaps = interval_gaps(window)
    doubled = interval_doubles(window)
    missed = [round(g, 3) for g in gaps if g >= 2 * PERIOD]
    senders = {s["pid"] for s in sent}
    print(
        f"\n[beat] redbeat, 3 beats, {STEADY_SLOTS} periods: gaps {min(gaps):.3f}..{max(gaps):.3f} s, "
        f"doubled {len(doubled)}, missed {len(missed)}; "
        f"redbeat's run count agreed with the sends ({ran})"
    )
    assert doubled == [] and missed == []
    assert len(senders) == 1, f"more than one beat dispatched: {senders}"
    assert any("redbeat's own lock" in beat.log_text() for beat in beats.procs)


@pytest.mark.timeout(60)
def test_sigkill_leader_over_redbeat(
    beats: Beats, records: Records, redlock: Redlock, redbeat_conf: dict[str, Any]
) -> None:
    beats.start(2, conf=redbeat_conf)
    check_sigkill_failover(beats, records, redlock, "redbeat", interval_doubles)


@pytest.mark.timeout(60)
def test_sigstopped_leader_over_redbeat(
    beats: Beats, records: Records, redlock: Redlock, redbeat_conf: dict[str, Any]
) -> None:
    beats.start(2, conf=redbeat_conf)
    check_sigstop(beats, records, redlock, "redbeat", interval_doubles)


@pytest.mark.timeout(90)
def test_entries_added_changed_disabled_through_redbeat_api(
    beats: Beats, records: Records, redlock: Redlock, redbeat_conf: dict[str, Any], redbeat_app: Celery
) -> None:
    """Each edit is honoured within one beat_max_loop_interval, before and after a failover."""
    first_key, changed_key, other_key = (f"{records.key}-{suffix}" for suffix in ("a", "b", "c"))
    bound = MAX_LOOP + SLACK  # a new redbeat entry is due at once; an edit shows at the next tick
    beats.start(2, conf=redbeat_conf, schedule={})
    first_leader = leader_pid(redlock, beats)

    added_at = time.time()
    RedBeatSchedulerEntry("x", TASK, schedule(PERIOD), args=[first_key], app=redbeat_app).save()
    wait_until(lambda: sends_to(records, first_key), 10, "the added entry to be sent")
    added_latency = sends_to(records, first_key)[0]["t"] - added_at

    changed_at = time.time()
    entry = stored(redbeat_app, "x")
    entry.args = [changed_key]
    entry.save()
    wait_until(lambda: sends_to(records, changed_key), 10, "the changed entry to be sent")
    changed_latency = sends_to(records, changed_key)[0]["t"] - changed_at

    # Whoever leads next reads the schedule as it stands.
    beats.by_pid(first_leader).kill()
    second_leader, _ = new_leader(redlock, first_leader, timeout=15)
    wait_until(
        lambda: [s for s in sends_to(records, changed_key) if s["pid"] == second_leader],
        10,
        "the new leader to send the changed entry",
    )
    added2_at = time.time()
    RedBeatSchedulerEntry("y", TASK, schedule(PERIOD), args=[other_key], app=redbeat_app).save()
    wait_until(lambda: sends_to(records, other_key), 10, "the second added entry to be sent")
    added2_latency = sends_to(records, other_key)[0]["t"] - added2_at

    disabled_at = time.time()
    entry = stored(redbeat_app, "x")
    entry.enabled = False
    entry.save()
    settled = disabled_at + bound
    wait_until(
        lambda: len([s for s in sends_to(records, other_key) if s["t"] > settled]) >= 3,
        15,
        "three more sends of the other entry",
    )

    late_first = [s for s in sends_to(records, first_key) if s["t"] > changed_at + bound]
    late_changed = [s for s in sends_to(records, changed_key) if s["t"] > settled]
    doubled = {k: interval_doubles(sends_to(records, k)) for k in (first_key, changed_key, other_key)}
    print(
        f"\n[beat] redbeat entry API: added sent after {added_latency:.2f} s, changed after "
        f"{changed_latency:.2f} s, added after failover {added2_latency:.2f} s (bound {bound:.1f} s); "
        f"sent after being changed {len(late_first)}, after being disabled {len(late_changed)}"
    )
    assert added_latency <= bound and added2_latency <= bound
    assert changed_latency <= bound + PERIOD  # the changed entry keeps its last run: due a period after it
    assert late_first == [] and late_changed == []
    assert all(v == [] for v in doubled.values()), doubled
    assert {s["pid"] for s in sends_to(records, other_key)} == {second_leader}


# -- found by the adversarial review of #15 ------------------------------------------------------
@pytest.mark.timeout(90)
def test_redbeat_leader_that_lost_its_lock_while_writing_the_run_sends_nothing(
    beats: Beats,
    records: Records,
    redlock: Redlock,
    redbeat_conf: dict[str, Any],
    redbeat_redis: RedisServer,
) -> None:
    """ "Validity is checked again just before every message is sent": over redbeat the check runs
    before the run is written to redbeat's Redis (RedlockScheduler.apply_async -> reserve), and
    not again after it. A leader whose write stalls (redbeat's Redis slow or failing over) and
    which loses its lock meanwhile (paused past its TTL) still sends once the write returns,
    although a successor leads by then: the tick is sent twice, once by a process that knows it
    lost the lock (django-celery-beat's path, through Scheduler.tick -> apply_entry, checks again
    after the write and does not send)."""
    beats.start(2, conf=redbeat_conf)
    old = leader_pid(redlock, beats)
    wait_sends(records, old, 2, timeout=10)
    proc = beats.by_pid(old)
    store = redis.Redis(host=redbeat_redis.host, port=redbeat_redis.port, socket_timeout=5)
    try:
        store.execute_command("CLIENT", "PAUSE", 60000, "WRITE")  # redbeat's Redis stalls writes
        paused_store_at = time.time()
        before = proc.log_text().count("Sending due task")
        # redbeat logs "Sending due task" before apply_async, where the run is written first.
        wait_until(
            lambda: proc.log_text().count("Sending due task") > before, 5, "the leader to start a send"
        )
        time.sleep(0.3)  # an observation window: the send does not complete while writes stall
        assert not [s for s in records.sent_by(old) if s["t"] > paused_store_at + 0.2]

        proc.pause()
        new, elected_at = new_leader(redlock, old, timeout=TTL + STANDBY + 10)
        proc.resume()
        proc.wait_for_log(r"beat leader lock \S+ lost", timeout=TTL + 5)
    finally:
        store.execute_command("CLIENT", "UNPAUSE")
        store.close()
    unpaused_at = time.time()
    wait_sends(records, new, 2, timeout=10, after=unpaused_at)
    time.sleep(0.5)  # an observation window for a late send of the old leader
    late = [s for s in records.sent_by(old) if s["t"] > elected_at]
    print(f"\nredbeat: old leader sent {len(late)} after the new one was elected: {late}")
    assert late == [], "a leader that had lost its lock sent after its successor was elected"
