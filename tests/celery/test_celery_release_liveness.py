"""``celery redlock release`` without ``--force`` against real workers (issue 25, item 1): each
run's holder record carries the interval its heartbeat really extends at (none without
heartbeat), and the release refuses a task extended every 2 s on a 3 s TTL for its whole body,
so no duplicate ever runs beside it; a task running without heartbeat, its validity left, is
refused too."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import celery_cli, listed

from celery_redlock import Redlock
from celery_redlock.lock import admin
from celery_redlock.testing import CeleryWorker, Hold, RedisServer, ServerSet, find_overlaps

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
QUEUE = f"q-liveness-{uuid.uuid4().hex[:8]}"


def app_env(broker: RedisServer, masters: ServerSet) -> dict[str, str]:
    return {
        "LIVENESSAPP_BROKER": broker.url,
        "LIVENESSAPP_MASTERS": ",".join(masters.urls),
        "LIVENESSAPP_QUEUE": QUEUE,
    }


@pytest.fixture(scope="module")
def livenessapp(broker: RedisServer, _redlock_server_set: ServerSet) -> Any:
    os.environ.update(app_env(broker, _redlock_server_set))
    import livenessapp as module

    module.app.conf.update(
        broker_url=broker.url, result_backend=broker.url, redlock_masters=_redlock_server_set.urls
    )
    module.BROKER = broker.url
    return module


@pytest.fixture(scope="module")
def worker(livenessapp: Any, broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[CeleryWorker]:
    """One prefork worker of three processes: a run and its duplicates can run side by side."""
    started = CeleryWorker(
        "livenessapp",
        pool="prefork",
        concurrency=3,
        queues=[QUEUE],
        env=app_env(broker, _redlock_server_set),
        pythonpath=[str(HERE), str(ROOT)],
    )
    try:
        yield started.start()  # type: ignore[misc]
    finally:
        started.stop()


@pytest.fixture
def ready(worker: CeleryWorker, redlock_masters: ServerSet) -> CeleryWorker:
    assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return worker


def cli(
    broker: RedisServer, masters: ServerSet, *args: str, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """``celery -A livenessapp redlock <args>``, as an operator runs it."""
    return celery_cli("livenessapp", app_env(broker, masters), *args, timeout=timeout)


def wait_for_records(
    broker: RedisServer, name: str, event: str, count: int, timeout: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in listed(broker, name) if r["event"] == event]
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {count} {event} records in {name}")
        time.sleep(0.05)


def holds(runs: list[dict[str, Any]]) -> list[Hold]:
    starts = {r["task_id"]: r for r in runs if r["event"] == "start"}
    ends = {r["task_id"]: r for r in runs if r["event"] == "end"}
    return [Hold(starts[t]["key"], starts[t]["at"], ends[t]["at"], owner=t) for t in starts if t in ends]


@pytest.mark.timeout(120)
def test_each_runs_record_carries_the_interval_its_heartbeat_extends_at(
    livenessapp: Any, ready: CeleryWorker, broker: RedisServer, redlock_masters: ServerSet
) -> None:
    tag = uuid.uuid4().hex[:8]
    tasks = {"slow": 2.0, "default": 1.0, "nobeat": None}  # default: a third of its 3 s TTL
    results = [getattr(livenessapp, task).delay(f"{tag}-{task}", 3.0, tag) for task in tasks]
    wait_for_records(broker, tag, "start", 3, 60)
    with Redlock(redlock_masters.urls, retry_count=0) as rl:
        for task, interval in tasks.items():
            name = getattr(livenessapp, task).lock_name((f"{tag}-{task}", 3.0, tag))
            view = admin.show(rl, name)
            assert view.held and view.holder is not None, view
            assert view.holder.name == f"livenessapp.{task}" and view.holder.heartbeat == interval, (
                view.holder
            )

        # Without heartbeat and with validity left, it is not shown dead: refused.
        name = livenessapp.nobeat.lock_name((f"{tag}-nobeat", 3.0, tag))
        token = admin.show(rl, name).token
        with pytest.raises(admin.ReleaseRefused, match="no heartbeat interval"):
            admin.release(rl, name, watch=2)
        assert admin.show(rl, name).token == token
    for result in results:
        assert result.get(timeout=60) is not None
    assert not [r for r in listed(broker, tag) if r["event"] == "end" and r["lost"]]


def release_through_a_run(livenessapp: Any, broker: RedisServer, masters: ServerSet) -> str | None:
    """One run of 9 s extended every 2 s on a 3 s TTL, three duplicates waiting for its lock, and
    operator releases tried through its first 3 s. None when the run kept its lock; else why it
    lost it, by its own account (a host too loaded to let its heartbeat extend in time).

    Every release must refuse while the run keeps its lock, and none may ever delete its token:
    a release that found the token gone (the run lost its lock) must have deleted nothing."""
    tag = uuid.uuid4().hex[:8]
    first = livenessapp.slow.delay(tag, 9.0, tag)
    (started,) = wait_for_records(broker, tag, "start", 1, 60)
    # Duplicates of it wait for its lock (lock_contended="retry"), in the two free processes.
    duplicates = [livenessapp.slow.delay(tag, 0.2, tag) for _ in range(3)]
    name = livenessapp.slow.lock_name((tag, 9.0, tag))
    outputs = []
    # Releases tried through its body (each takes a CLI start-up and about one interval of
    # watching), the last one starting 3 s in, well before the body ends at 9 s.
    while time.monotonic() - started["at"] < 3.0:
        tried = cli(broker, masters, "release", name, "--yes")
        outputs.append((tried.returncode, tried.stdout + tried.stderr))
        if tried.returncode != 1:
            assert " on 0 of " in tried.stdout, f"a release deleted a token: {tried.stdout}"
    assert first.get(timeout=60) == tag
    for result in duplicates:
        assert result.get(timeout=60) == tag
    runs = listed(broker, tag)
    (first_end,) = [r for r in runs if r["event"] == "end" and r["task_id"] == first.id]
    if first_end["lost"]:
        return str(first_end["lost"])
    for code, output in outputs:
        assert code == 1, output
        assert "holder is alive" in output and "refused" in output, output
        assert "extended every 2 s (recorded)" in output, output
    assert not [r for r in runs if r["event"] == "end" and r["lost"]], runs
    found = holds(runs)
    assert len(found) == 4, runs
    assert not find_overlaps(found), [str(o) for o in find_overlaps(found)]
    assert len(outputs) >= 1
    return None


@pytest.mark.timeout(240)
def test_release_never_frees_a_task_extended_every_2_s_on_a_3_s_ttl_and_no_duplicate_runs_beside_it(
    livenessapp: Any, ready: CeleryWorker, broker: RedisServer, redlock_masters: ServerSet
) -> None:
    # The premise is a run that keeps its lock. A host loaded past a second's scheduling delay can
    # make its heartbeat late and the lock lapse; the run then says so (its body checks owned()),
    # the releases are still checked to delete nothing, and the scenario is run again.
    lost = []
    for _ in range(3):
        why = release_through_a_run(livenessapp, broker, redlock_masters)
        if why is None:
            return
        lost.append(why)
    raise AssertionError(
        f"the run lost its lock in every attempt: {lost}; worker log:\n{ready.log_tail(8000)}"
    )
