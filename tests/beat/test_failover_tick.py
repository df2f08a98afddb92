"""A failover loses no tick: two RedlockScheduler beats, the leader SIGKILLed or SIGSTOPped about
two seconds before a crontab minute boundary; the tick of that minute runs exactly once.

At the boundary the dead (or paused) leader's lock is still valid, so nobody may send; a standby
takes the lead up to a TTL plus one standby tick later, and must then send the tick that fell
due in that gap, once, stamped with its slot. Six fleets of two beats run side by side so that
they share one wait for a boundary: one per fault and kind of wrapped scheduler (celery's
``PersistentScheduler``; django-celery-beat's ``DatabaseScheduler`` on a PostgreSQL database of
the fleet's own; redbeat on its own keys), each with a leader lock and a record key of its own.

Runs are counted by the slot stamp the task body read from its message (``beatapp.stamped``),
not by send or run time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from celery_redlock import Redlock
from celery_redlock.beat import read_leader
from celery_redlock.celery.slots import render
from celery_redlock.testing import RedisServer, ServerSet

from . import redbeat_config
from .conftest import ROOT, Beats, Records, pg_admin, pg_required, pg_unreachable, wait_until
from .django_settings import celery_settings

TTL = 3.0
STANDBY = 0.5
SCHEDULER = "celery_redlock.beat:RedlockScheduler"
TASK = "tests.beat.beatapp.stamped"
# The fault comes this long before the boundary: the lock (extended every TTL/3) is still valid
# at the boundary, and a standby takes over at most TTL + STANDBY after the fault.
FAULT_LEAD = 2.0
# The least time from the leaders' election to the fault: the standbys follow a few ticks first.
SETTLE = 3.0
KINDS = ("default", "django", "redbeat")
FAULTS = ("SIGKILL", "SIGSTOP")


@dataclass
class Fleet:
    """Two beats over one kind of wrapped scheduler, their own leader lock and record key."""

    kind: str
    fault: str
    beats: Beats
    key: str
    conf: dict[str, Any]
    scheduler: str | None = None
    leader: int = 0
    successor: int = 0
    elected_at: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.fault}"

    @property
    def lock_name(self) -> str:
        return str(self.conf["redlock_beat_lock_name"])

    def start(self) -> None:
        schedule = {f"tick-{self.key}": {"task": TASK, "crontab": {"minute": "*"}, "args": [self.key]}}
        self.beats.start(2, conf=self.conf, scheduler=self.scheduler, schedule=schedule, wait=False)

    def _list(self, records: Records, suffix: str) -> list[dict[str, Any]]:
        return [json.loads(item) for item in records.client.lrange(f"{self.key}:{suffix}", 0, -1)]

    def sent(self, records: Records) -> list[dict[str, Any]]:
        return self._list(records, "sent")

    def runs(self, records: Records) -> list[dict[str, Any]]:
        return self._list(records, "runs")

    def done(self, records: Records) -> list[dict[str, Any]]:
        return self._list(records, "done")


@contextmanager
def fresh_databases(count: int) -> Iterator[list[str]]:
    """``count`` new PostgreSQL databases, django-celery-beat migrated into each by ``manage.py
    migrate`` in a process of its own (this process's Django, if any, stays on its own database);
    dropped after."""
    names = [f"celery_redlock_failover_{uuid.uuid4().hex[:12]}" for _ in range(count)]
    try:
        with pg_admin() as admin:
            for name in names:
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        migrations = [
            subprocess.Popen(
                [sys.executable, "-m", "django", "migrate", "django_celery_beat", "--verbosity", "0"],
                env={
                    **os.environ,
                    "DJANGO_SETTINGS_MODULE": "tests.beat.django_settings",
                    "BEAT_TEST_PG_DB": name,
                    "PYTHONPATH": str(ROOT),
                },
                cwd=ROOT,
            )
            for name in names
        ]
        for migration in migrations:
            assert migration.wait(timeout=120) == 0, "django-celery-beat's migrations failed"
        yield names
    finally:
        with pg_admin() as admin:
            for name in names:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def leader_of(redlock: Redlock, fleet: Fleet) -> int | None:
    record = read_leader(redlock, fleet.lock_name)
    return int(record["pid"]) if record else None


def next_boundary(earliest: float) -> float:
    """The first minute boundary at or after ``earliest`` (seconds since the epoch)."""
    return math.ceil(earliest / 60) * 60.0


@pytest.fixture
def fleets(
    beat_env: dict[str, str],
    records: Records,
    tmp_path: Path,
    redlock_masters: ServerSet,
    redbeat_redis: RedisServer,
) -> Iterator[list[Fleet]]:
    """One fleet per fault and kind (the django ones only where PostgreSQL is usable, or a
    failure if CELERY_REDLOCK_REQUIRE_POSTGRES=1); every beat stopped by pid after the test."""
    kinds = list(KINDS)
    reason = pg_unreachable()
    if reason is not None:
        if pg_required():
            pytest.fail(f"{reason} (CELERY_REDLOCK_REQUIRE_POSTGRES=1)")
        kinds.remove("django")
        warnings.warn(pytest.PytestWarning(f"django-celery-beat fleets left out: {reason}"), stacklevel=1)
    with ExitStack() as stack:
        databases = iter(stack.enter_context(fresh_databases(len(FAULTS))) if "django" in kinds else [])
        made: list[Fleet] = []
        for fault in FAULTS:
            for kind in kinds:
                key = f"{records.key}-{kind}-{fault.lower()}"
                conf: dict[str, Any] = {
                    "redlock_beat_lock_ttl": TTL,
                    "redlock_beat_standby_interval": STANDBY,
                    "redlock_beat_lock_name": f"beat:{key}",
                }
                env = dict(beat_env)
                scheduler: str | None = SCHEDULER
                if kind == "django":
                    conf.update(celery_settings())  # beat_scheduler among them
                    env.update(
                        DJANGO_SETTINGS_MODULE="tests.beat.django_settings", BEAT_TEST_PG_DB=next(databases)
                    )
                    scheduler = None
                elif kind == "redbeat":
                    conf.update(
                        redbeat_config.settings(),
                        redbeat_redis_url=redbeat_redis.url,
                        redbeat_key_prefix=f"redbeat:{key}:",
                    )
                    scheduler = None
                beats = Beats(env, records, tmp_path / f"{kind}-{fault.lower()}")
                stack.callback(beats.stop_all)
                made.append(Fleet(kind, fault, beats, key, conf, scheduler))
        yield made


@pytest.mark.slow  # it waits for a minute boundary: about 35 to 95 s
@pytest.mark.timeout(180)
def test_failover_sends_the_tick_that_fell_due_in_the_gap_exactly_once(
    fleets: list[Fleet], records: Records, redlock: Redlock, beat_worker: object
) -> None:
    for fleet in fleets:
        fleet.start()
    for fleet in fleets:
        for proc in fleet.beats.procs:
            proc.wait_ready()
    for fleet in fleets:
        fleet.leader = wait_until(lambda f=fleet: leader_of(redlock, f), 15, f"a leader of {fleet.label}")

    boundary = next_boundary(time.time() + SETTLE + FAULT_LEAD)
    slot = render(boundary)
    time.sleep(max(0.0, boundary - FAULT_LEAD - time.time()))  # the wait is the clock's, computed
    faulted_at = time.time()
    for fleet in fleets:
        assert leader_of(redlock, fleet) == fleet.leader, f"{fleet.label}: the leader changed by itself"
        leader = fleet.beats.by_pid(fleet.leader)
        if fleet.fault == "SIGKILL":
            leader.kill()
        else:
            leader.pause()
    done_faulting = time.time()
    # Every fault must land while the lock is valid and before the boundary, or this tested nothing.
    assert boundary - done_faulting > 0.5, (
        f"the faults ended {boundary - done_faulting:.2f} s before the boundary"
    )

    for fleet in fleets:
        fleet.successor = wait_until(
            lambda f=fleet: (pid := leader_of(redlock, f)) != f.leader and pid,
            TTL + STANDBY + 15,
            f"a new leader of {fleet.label}",
        )
        fleet.elected_at = time.time()
    # A paused leader is resumed once its lock has surely expired; it must find out and send nothing.
    wait_until(lambda: time.time() - faulted_at > TTL, TTL + 1, "the pause to outlast the TTL")
    for fleet in fleets:
        if fleet.fault == "SIGSTOP":
            old = fleet.beats.by_pid(fleet.leader)
            old.resume()
            old.wait_for_log(r"beat leader lock \S+ lost", timeout=TTL + 5)

    def ran_the_tick(fleet: Fleet) -> bool:
        return any(r.get("stamp") == slot for r in fleet.runs(records))

    deadline = boundary + TTL + STANDBY + 30 - time.time()
    missing: list[str] = []
    try:
        wait_until(
            lambda: all(ran_the_tick(f) for f in fleets), deadline, f"every fleet to run the {slot} tick"
        )
    except AssertionError:
        missing = [f.label for f in fleets if not ran_the_tick(f)]
    # Whatever was sent has finished on the worker, and a second copy had time to come.
    time.sleep(1.0)  # an observation window, not a synchronisation
    for fleet in fleets:
        wait_until(
            lambda f=fleet: {s["id"] for s in f.sent(records)} <= {d["id"] for d in f.done(records)},
            20,
            f"the worker to finish what {fleet.label} sent",
        )

    report = []
    wrong = []
    for fleet in fleets:
        sends = [s for s in fleet.sent(records) if s.get("slot") == slot]
        runs = [r for r in fleet.runs(records) if r.get("stamp") == slot]
        late = [s for s in fleet.sent(records) if s["pid"] == fleet.leader and s["t"] > faulted_at]
        first = min((s["t"] for s in sends), default=None)
        report.append(
            f"{fleet.label}: elected {fleet.elected_at - faulted_at:.2f} s after the fault, "
            f"the {slot[11:19]} tick run {len(runs)}x (sent {len(sends)}x"
            + (f", first {first - boundary:+.2f} s after the boundary" if first is not None else "")
            + f"), old leader sent {len(late)} after the fault"
        )
        if len(runs) != 1 or len(sends) != 1 or late:
            wrong.append(fleet.label)
    print(f"\n[beat] failover {FAULT_LEAD:g} s before {slot} (TTL {TTL:g} s):\n  " + "\n  ".join(report))
    assert not missing and not wrong, f"not run exactly once: {sorted(set(missing + wrong))}"
