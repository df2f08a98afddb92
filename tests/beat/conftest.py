"""Fixtures for the beat tests: a broker of their own, one shared worker, beat processes, and the
stores of the wrapped schedulers with shared state (a PostgreSQL database for django-celery-beat,
a Redis for redbeat).

Every test records into keys of its own (a fresh ``key``), so the session-wide worker and
broker are never flushed under a running process.
"""

from __future__ import annotations

import json
import math
import os
import socket
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from psycopg import sql

from celery_redlock import Redlock
from celery_redlock.beat import read_leader
from celery_redlock.testing import RedisServer, ServerSet
from celery_redlock.testing.celery import CeleryBeat, CeleryWorker
from tests.waiting import wait_until as wait_until  # the beat tests import it from here

from .django_settings import PG_HOST, PG_PORT, PG_USER, settings_for

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.beat.beatapp"
LOCK_NAME = "beat:beattests"  # the default: "beat:" + the app's main name
POLL = 0.05


def slot_of(t: float, period: float = 1.0) -> int:
    """The slot a RedlockScheduler message published at ``t`` was for.

    Its interval ticks are aligned to the epoch and sent at or after their boundary (never
    before: the tick is due only once the boundary has passed), so flooring tolerates up to a
    whole period of scheduling delay on a loaded machine.
    """
    return math.floor(t / period)


@pytest.fixture(scope="session")
def beat_broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redbeat_redis() -> Iterator[RedisServer]:
    """redbeat's own Redis: neither a lock master nor the broker."""
    with RedisServer() as server:
        yield server


def pg_admin() -> psycopg.Connection[Any]:
    return psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres", autocommit=True, connect_timeout=5
    )


def pg_unreachable() -> str | None:
    """Why PostgreSQL cannot be used here, or None."""
    try:
        socket.create_connection((PG_HOST, PG_PORT), timeout=1.0).close()
        pg_admin().close()
    except (OSError, psycopg.Error) as exc:
        return f"PostgreSQL at {PG_HOST}:{PG_PORT} (user {PG_USER}) not usable: {exc}"
    return None


def pg_required() -> bool:
    """Whether a PostgreSQL that cannot be used fails the tests that need it (CI) or skips them."""
    return os.environ.get("CELERY_REDLOCK_REQUIRE_POSTGRES") == "1"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A database of this session's own, django-celery-beat migrated into it; dropped after.

    It configures Django in the test process (once per process: every test that edits the
    schedule through the ORM shares it)."""
    reason = pg_unreachable()
    if reason is not None:
        if pg_required():
            pytest.fail(f"{reason} (CELERY_REDLOCK_REQUIRE_POSTGRES=1)")
        pytest.skip(f"{reason} (set CELERY_REDLOCK_REQUIRE_POSTGRES=1 to make this a failure)")
    import django
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    name = f"celery_redlock_beat_{uuid.uuid4().hex[:12]}"
    with pg_admin() as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        if settings.configured:
            pytest.fail("Django is already configured in this process; these tests configure it")
        settings.configure(**settings_for(name))
        django.setup()
        call_command("migrate", "django_celery_beat", verbosity=0)
        yield name
    finally:
        connections.close_all()
        with pg_admin() as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def beat_env(beat_broker: RedisServer, _redlock_server_set: ServerSet) -> dict[str, str]:
    return {"BEAT_TEST_BROKER": beat_broker.url, "BEAT_TEST_MASTERS": ",".join(_redlock_server_set.urls)}


@pytest.fixture(scope="session")
def beat_worker(beat_env: dict[str, str]) -> Iterator[CeleryWorker]:
    """One real worker for the session: 4 threads, so overlapping runs would be possible."""
    worker = CeleryWorker(APP, pool="threads", concurrency=4, env=beat_env, pythonpath=[ROOT])
    with worker:
        yield worker


class Records:
    """What the processes of one test recorded under its own key, on the broker's server."""

    def __init__(self, broker: RedisServer) -> None:
        self.key = f"t-{uuid.uuid4().hex[:12]}"
        self.client = redis.Redis(host=broker.host, port=broker.port, db=2, socket_timeout=5)

    def _list(self, suffix: str) -> list[dict[str, Any]]:
        return [json.loads(item) for item in self.client.lrange(f"{self.key}:{suffix}", 0, -1)]

    def sent(self) -> list[dict[str, Any]]:
        return self._list("sent")

    def runs(self) -> list[dict[str, Any]]:
        return self._list("runs")

    def done(self) -> list[dict[str, Any]]:
        return self._list("done")

    def sent_by(self, pid: int) -> list[dict[str, Any]]:
        return [s for s in self.sent() if s["pid"] == pid]

    def published(self) -> list[dict[str, Any]]:
        """The sends that reached the broker (a beat stopped mid-publish recorded a send only)."""
        return self._list("published")

    def wait_all_done(self, timeout: float = 20.0) -> None:
        """Until the worker finished (ran or skipped) every message the beats published."""

        def missing() -> set[str]:
            return {p["id"] for p in self.published()} - {d["id"] for d in self.done()}

        try:
            wait_until(lambda: not missing(), timeout, "the worker to finish every published message")
        except AssertionError as error:
            ids = missing()
            sends = [s for s in self.sent() if s["id"] in ids]
            runs = [r for r in self.runs() if r["id"] in ids]
            raise AssertionError(f"{error}; not finished: their sends {sends}, their runs {runs}") from None


@pytest.fixture
def records(beat_broker: RedisServer) -> Iterator[Records]:
    rec = Records(beat_broker)
    yield rec
    rec.client.close()


class Beats:
    """Starts ``celery beat`` processes for one test and stops them all (by pid) after it."""

    def __init__(self, env: dict[str, str], records: Records, tmp: Path) -> None:
        self.env = env
        self.records = records
        self.tmp = tmp
        self.procs: list[CeleryBeat] = []

    def start(
        self,
        count: int,
        *,
        every: float = 1.0,
        task: str = "tests.beat.beatapp.record",
        args: list[Any] | None = None,
        conf: dict[str, Any] | None = None,
        scheduler: str | None = None,
        wait: bool = True,
        schedule: dict[str, Any] | None = None,
    ) -> list[CeleryBeat]:
        """Start ``count`` beats; their ``beat_schedule`` is one ``job`` (``task`` every ``every``
        seconds, args ``[key, *args]``), or ``schedule`` (``{name: {"task", "every", "args"}}``)."""
        if schedule is None:
            schedule = {"job": {"task": task, "every": every, "args": [self.records.key, *(args or [])]}}
        env = dict(
            self.env,
            BEAT_TEST_RECORD="1",
            BEAT_TEST_SCHEDULE=json.dumps(schedule),
            BEAT_TEST_CONF=json.dumps(conf or {}),
        )
        started = []
        for _ in range(count):
            name = f"beat{len(self.procs) + 1}"
            proc = CeleryBeat(
                APP, scheduler=scheduler, env=env, pythonpath=[ROOT], log_dir=self.tmp / name, name=name
            )
            self.procs.append(proc)
            started.append(proc.start(wait=False))
        if wait:
            for proc in started:
                proc.wait_ready()
        return started

    def by_pid(self, pid: int) -> CeleryBeat:
        return next(p for p in self.procs if p.pid == pid)

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop(timeout=5)


@pytest.fixture
def beats(
    beat_env: dict[str, str], records: Records, tmp_path: Path, redlock_masters: ServerSet
) -> Iterator[Beats]:
    fleet = Beats(beat_env, records, tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()


@pytest.fixture
def django_beats(beats: Beats, pg_database: str) -> Beats:
    """The beats fixture, its processes set up as a Django project's over this session's database,
    and the schedule emptied."""
    from django_celery_beat.models import PeriodicTask

    PeriodicTask.objects.all().delete()
    beats.env = {
        **beats.env,
        "DJANGO_SETTINGS_MODULE": "tests.beat.django_settings",
        "BEAT_TEST_PG_DB": pg_database,
    }
    return beats


def current_leader(redlock: Redlock) -> dict[str, Any] | None:
    return read_leader(redlock, LOCK_NAME)


def count_slots(sends: list[dict[str, Any]], first: int, last: int) -> tuple[list[int], list[int]]:
    """(doubled, missed) slots in ``first..last`` among ``sends``."""
    counts = Counter(slot_of(s["t"]) for s in sends)
    doubled = sorted(k for k in range(first, last + 1) if counts[k] > 1)
    missed = sorted(k for k in range(first, last + 1) if counts[k] == 0)
    return doubled, missed
