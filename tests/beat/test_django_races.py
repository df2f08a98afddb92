"""Two races of a django-celery-beat leader with its database, made to happen on every run
(real ``celery beat`` processes, the real PostgreSQL of ``pg_database``, the 5 real masters):

- the leader writes a run to the store while its validity sits in the dip every heartbeat cycle
  brings (below ``redlock_beat_min_validity``, yet healthy): the run must still be sent, or the
  store records a run nobody sent and no failover makes up for it;
- an admin commits a new entry while a new leader is setting up: the leader must run it within a
  tick or two, not at django-celery-beat's 5-minute re-read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis

from celery_redlock import Redlock
from celery_redlock.lock.resource import lock_key
from celery_redlock.testing import ServerSet

from .conftest import LOCK_NAME, POLL, Beats, Records, current_leader, wait_until
from .django_settings import PG_HOST, PG_PORT, PG_USER
from .ha_checks import stamp_doubles
from .test_beat_django import DJANGO_CONF, add_entry, sends_to
from .test_ha import TTL, leader_pid

ROUNDS = 4
# The leader counts its validity from the start of each heartbeat extension, for the interval
# (TTL/3) plus a margin of half of it: TTL/2 just after, TTL/6 before the next, one interval
# later. Below redlock_beat_min_validity (TTL/3) from TTL/6 after an extension on: a release of
# the row in this window lets the leader go on to send while its validity is in that dip.
DIP = (TTL / 6 + 0.05, TTL / 6 + 0.2)


def _connect(database: str, *, autocommit: bool) -> psycopg.Connection[Any]:
    return psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=database, autocommit=autocommit, connect_timeout=5
    )


@pytest.fixture
def pg_watch(pg_database: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection of the test's own, to see the beats' sessions wait on a row lock."""
    with _connect(pg_database, autocommit=True) as conn:
        yield conn


def _someone_waits_on_a_lock(conn: psycopg.Connection[Any], database: str) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'", (database,)
    ).fetchone()
    return bool(row and row[0])


def _since_extension(masters: list[redis.Redis], key: str, quorum: int) -> float | None:
    """Seconds since the leader lock was last extended, from the freshest TTL left on the masters
    (each extension sets the full TTL); None without a quorum of them holding it. The leader counts
    from before its round, so it is at least this far into its cycle."""
    live = [ms for ms in (m.pttl(key) for m in masters) if ms > 0]
    return TTL - max(live) / 1000 if len(live) >= quorum else None


def _wait_for_the_dip(masters: list[redis.Redis], key: str, quorum: int) -> float:
    """Until the leader lock is DIP[0] to DIP[1] past its latest extension; that offset. Polled
    finely: the window is 0.15 s wide, and one heartbeat cycle (TTL/3) brings it round again."""
    deadline = time.monotonic() + 3 * TTL
    while time.monotonic() < deadline:
        since = _since_extension(masters, key, quorum)
        if since is not None and DIP[0] <= since <= DIP[1]:
            return since
        time.sleep(0.005)
    raise AssertionError(f"the leader lock never sat {DIP} s past an extension within {3 * TTL} s")


def _runs_and_sends(records: Records, timeout: float = 5.0) -> tuple[int, int]:
    """(runs the job's row records, sends recorded) once the two agree, or as last read at the
    deadline. The row is read on both sides of the sends: a run written in between makes the
    reading unsteady, and it is read again."""
    from django_celery_beat.models import PeriodicTask

    deadline = time.monotonic() + timeout
    counts = (-1, -1)
    while True:
        before = PeriodicTask.objects.get(name="job").total_run_count
        sent = len(records.sent())
        if PeriodicTask.objects.get(name="job").total_run_count == before:
            counts = (before, sent)
            if before == sent:
                return counts
        if time.monotonic() >= deadline:
            return counts
        time.sleep(POLL)


@pytest.mark.timeout(60)
def test_a_run_written_in_the_validity_dip_is_sent(
    django_beats: Beats,
    records: Records,
    redlock: Redlock,
    redlock_masters: ServerSet,
    pg_database: str,
    pg_watch: psycopg.Connection[Any],
) -> None:
    """An admin's open transaction holds the job's row, so the leader's write of a run waits on
    it; the row is released when the leader lock is in the dip. Every run the row records must
    have been sent, each stamp once, and the lead never moves."""
    django_beats.start(2, conf=DJANGO_CONF)
    leader = leader_pid(redlock, django_beats)
    wait_until(lambda: records.sent_by(leader), 10, "the leader's first send")
    key = lock_key(redlock.key_prefix, LOCK_NAME)
    masters = [redis.Redis.from_url(url, socket_timeout=2) for url in redlock_masters.urls]
    dips: list[float] = []
    try:
        for _ in range(ROUNDS):
            holder = _connect(pg_database, autocommit=False)
            try:
                with holder.transaction():
                    holder.execute(
                        "SELECT id FROM django_celery_beat_periodictask WHERE name = 'job' FOR UPDATE"
                    )
                    wait_until(
                        lambda: _someone_waits_on_a_lock(pg_watch, pg_database),
                        5,
                        "the leader's write of a run to wait on the row",
                    )
                    dips.append(_wait_for_the_dip(masters, key, redlock.quorum))
            finally:
                holder.close()  # the row is free: the leader writes the run and goes on to send
            released_at = time.time()
            # One round at a time: the next hold begins once the leader has sent again.
            wait_until(
                lambda r=released_at: [s for s in records.sent_by(leader) if s["t"] > r],
                5,
                "a send after the row was released",
            )

        counts = _runs_and_sends(records)
    finally:
        for master in masters:
            master.close()
    sent = records.sent()
    record = current_leader(redlock)
    print(
        f"\n[beat] django-celery-beat, row released {', '.join(f'{d:.2f}' for d in dips)} s after an "
        f"extension: the row records {counts[0]} runs, {counts[1]} sent"
    )
    assert counts[0] == counts[1], f"runs recorded but never sent: {counts[0] - counts[1]}"
    assert stamp_doubles(sent) == []
    assert {s["pid"] for s in sent} == {leader}
    assert record is not None and int(record["pid"]) == leader  # no failover: the lead never moved


@pytest.mark.timeout(60)
def test_an_entry_committed_while_a_leader_sets_up_is_run(
    django_beats: Beats,
    records: Records,
    redlock: Redlock,
    pg_database: str,
    pg_watch: psycopg.Connection[Any],
) -> None:
    """The admin adds an entry (its save moves PeriodicTasks.last_update, as the model's signals
    do) in a transaction left open while the beats start and a leader reads the rows and writes
    its static entries; the leader's write waits for that transaction, which then commits."""
    from django.db import transaction

    added = f"{records.key}-added"
    with transaction.atomic():
        add_entry("added", added)
        django_beats.start(2, conf=DJANGO_CONF, schedule={})
        wait_until(
            lambda: _someone_waits_on_a_lock(pg_watch, pg_database),
            20,
            "the new leader's setup to wait on the admin's transaction",
        )
    committed_at = time.time()
    sends = wait_until(
        lambda: sends_to(records, added), 10, "the entry committed during the setup to be sent"
    )
    leader = leader_pid(redlock, django_beats)
    wait_until(lambda: len(sends_to(records, added)) >= 3, 10, "three sends of the entry")
    sent = sends_to(records, added)
    print(
        f"\n[beat] an entry committed during a leader's setup: first sent "
        f"{sends[0]['t'] - committed_at:.2f} s after the commit"
    )
    assert {s["pid"] for s in sent} == {leader}
    assert stamp_doubles(sent) == []
