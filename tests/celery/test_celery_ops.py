"""The operators' commands and the metrics with real workers: ``celery -A opsapp redlock ls /
show / release`` while tasks hold locks on two prefork workers, a SIGKILLed holder's lock freed
by hand (a contender then gets in at once, long before its 60 s TTL), a live holder's refused,
and each worker's ``/metrics`` endpoint (prometheus-client's own server, multiprocess mode over
its pool children) scraped while tasks run, its counters matching what the tasks did."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import celery_cli, listed
from prometheus_client.parser import text_string_to_metric_families

from celery_redlock import Redlock
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from celery_redlock.testing.servers import free_port
from tests.onmasters import holding
from tests.waiting import wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUN = uuid.uuid4().hex[:8]
QUEUE = f"q-ops-{RUN}"
STARTED: list[CeleryWorker] = []  # the module's workers, for a failure's account


def ops_env(broker: RedisServer, masters: ServerSet) -> dict[str, str]:
    return {"OPSAPP_BROKER": broker.url, "OPSAPP_MASTERS": ",".join(masters.urls), "OPSAPP_QUEUE": QUEUE}


@pytest.fixture(scope="module")
def opsapp(broker: RedisServer, _redlock_server_set: ServerSet) -> Any:
    os.environ.update(ops_env(broker, _redlock_server_set))
    import opsapp as module

    module.app.conf.update(
        broker_url=broker.url, result_backend=broker.url, redlock_masters=_redlock_server_set.urls
    )
    module.BROKER = broker.url
    return module


@pytest.fixture(scope="module")
def workers(opsapp: Any, broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[list[CeleryWorker]]:
    """Two prefork workers of two processes each, each serving its metrics on a port of its own."""
    started: list[CeleryWorker] = []
    try:
        for _ in range(2):
            port = free_port()
            env = {**ops_env(broker, _redlock_server_set), "OPSAPP_METRICS": f"127.0.0.1:{port}"}
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            worker = CeleryWorker(
                "opsapp",
                pool="prefork",
                concurrency=2,
                queues=[QUEUE],
                env=env,
                pythonpath=[str(HERE), str(ROOT)],
            )
            worker.metrics_port = port  # type: ignore[attr-defined]
            started.append(worker.start())
        STARTED[:] = started
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
def ready(workers: list[CeleryWorker], redlock_masters: ServerSet) -> list[CeleryWorker]:
    for worker in workers:
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return workers


def cli(
    broker: RedisServer, masters: ServerSet, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``celery -A opsapp redlock <args>``, as an operator runs it."""
    return celery_cli("opsapp", ops_env(broker, masters), *args, timeout=timeout)


def started_runs(broker: RedisServer, name: str, count: int) -> list[dict[str, Any]]:
    try:
        return wait_until(
            lambda: (
                (found := [r for r in listed(broker, name) if r["event"] in ("start", "ran")])
                and len(found) >= count
                and found
            ),
            60,
            f"{count} runs to start",
        )
    except AssertionError as exc:  # what the workers were doing instead
        tails = "\n".join(f"{worker!r}:\n{worker.log_tail()}" for worker in STARTED)
        raise AssertionError(f"{exc}; found {listed(broker, name)}\n{tails}") from None


@pytest.mark.timeout(120)
def test_ls_and_show_while_tasks_hold_locks_on_two_workers(
    opsapp: Any, ready: list[CeleryWorker], broker: RedisServer, redlock_masters: ServerSet
) -> None:
    tag = uuid.uuid4().hex[:8]
    # Held until the checks below are done (the stop key), not for a fixed time a loaded
    # machine's slow CLI could outlast.
    results = [opsapp.hold.delay(f"{tag}-{i}", 60.0, tag) for i in range(4)]
    runs = started_runs(broker, tag, 4)
    by_task = {r["task_id"]: r["pid"] for r in runs}

    listed = cli(broker, redlock_masters, "ls", f"ops:{tag}-*", "--json")
    assert listed.returncode == 0, listed.stderr
    locks = json.loads(listed.stdout)["locks"]
    assert sorted(lock["name"] for lock in locks) == [f"ops:{tag}-{i}" for i in range(4)]
    for lock in locks:
        holder = lock["holder"]
        # Held on a quorum (what the worker's acquire promises; a master a loaded host made late
        # had its grant retracted), which "held" must agree with.
        assert lock["held"] and lock["agree"] >= 3 and lock["kind"] == "plain"
        assert holder["name"] == "opsapp.hold" and holder["ttl"] == 60
        assert by_task[holder["task"]] == holder["pid"]  # the process that runs the task holds it
        assert 40 < lock["ttl_left"] <= 60 and 0 <= lock["age"] < 30
    pids = {lock["holder"]["pid"] for lock in locks}
    children = [set(worker.child_pids()) for worker in ready]
    assert all(pids & mine for mine in children), "the four locks are not held on both workers"

    table = cli(broker, redlock_masters, "ls", f"ops:{tag}-*")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == [
        "RESOURCE",
        "HOLDER",
        "AGE",
        "TTL",
        "LEFT",
        "MASTERS",
    ]
    assert all(f"ops:{tag}-{i}" in table.stdout for i in range(4)) and "task opsapp.hold" in table.stdout

    shown = cli(broker, redlock_masters, "show", f"ops:{tag}-0")
    assert shown.returncode == 0, shown.stderr
    # One line per master holding it, as many as the summary counts (a quorum at least).
    agree = re.search(r"held on a quorum \((\d) of 5 masters, quorum 3\)", shown.stdout)
    assert agree and int(agree[1]) >= 3 and shown.stdout.count(" plain ") == int(agree[1]), shown.stdout
    assert "task opsapp.hold" in shown.stdout

    broker.client().set(f"{tag}:stop", 1)
    for result in results:
        assert result.get(timeout=60) is not None
    free = cli(broker, redlock_masters, "show", f"ops:{tag}-0")
    assert free.returncode == 1 and "not held on a quorum" in free.stdout


@pytest.mark.timeout(120)
def test_release_of_a_sigkilled_holders_lock_lets_a_contender_in_at_once(
    opsapp: Any, ready: list[CeleryWorker], broker: RedisServer, redlock_masters: ServerSet
) -> None:
    tag = uuid.uuid4().hex[:8]
    opsapp.hold.delay(tag, 120.0, tag)
    (run,) = started_runs(broker, tag, 1)
    os.kill(run["pid"], signal.SIGKILL)  # the pool child dies holding its lock (TTL 60 s)
    with Redlock(redlock_masters.urls, retry_count=0) as contender:
        assert not contender.lock(f"ops:{tag}", ttl=5).acquire(blocking=False)

        released = cli(broker, redlock_masters, "release", f"ops:{tag}", "--yes")
        assert released.returncode == 0, released.stdout + released.stderr
        assert "holder is gone" in released.stdout, released.stdout
        # Deleted wherever the dead run's token was: on a quorum at least, and on every master
        # but those its acquire found late on a loaded host (they were sent its retraction), so
        # no master is left holding it.
        deleted = re.search(r"on (\d) of 5 masters", released.stdout)
        assert deleted and int(deleted[1]) >= 3, released.stdout
        assert not any(holding(redlock_masters, f"redlock:ops:{tag}")), released.stdout
        at = time.monotonic()
        lock = contender.lock(f"ops:{tag}", ttl=5)
        assert lock.acquire(blocking=False), "the released lock was still held"
        assert time.monotonic() - at < 1.0
        lock.release()


@pytest.mark.timeout(120)
def test_release_is_refused_while_the_holder_runs_and_extends_it(
    opsapp: Any, ready: list[CeleryWorker], broker: RedisServer, redlock_masters: ServerSet
) -> None:
    tag = uuid.uuid4().hex[:8]
    # Running until told to stop: three CLI runs (a second or more each on a loaded host) and the
    # watch must all see the holder alive; a fixed 6 s run ended before the watch did ("holder is
    # expired", released on 0 of 5) under load.
    result = opsapp.busy.delay(tag, 60.0, tag)
    started_runs(broker, tag, 1)
    before = json.loads(cli(broker, redlock_masters, "show", f"ops:{tag}", "--json").stdout)
    assert before["held"]

    refused = cli(broker, redlock_masters, "release", f"ops:{tag}", "--yes", "--watch", "5")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "holder is alive" in refused.stdout and "refused" in refused.stderr
    after = json.loads(cli(broker, redlock_masters, "show", f"ops:{tag}", "--json").stdout)
    assert after["held"] and after["token"] == before["token"]
    broker.client().set(f"{tag}:stop", 1)
    assert result.get(timeout=60) == tag


# -- metrics -----------------------------------------------------------------------------------------
def scrape(worker: CeleryWorker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    port = worker.metrics_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
            samples[(sample.name, labels)] = samples.get((sample.name, labels), 0.0) + sample.value
    return samples


def total(workers: list[CeleryWorker], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(
        value
        for worker in workers
        for (sample, found), value in scrape(worker).items()
        if sample == name and want <= set(found)
    )


@pytest.mark.timeout(120)
def test_metrics_scraped_while_tasks_run_match_what_the_tasks_did(
    opsapp: Any, ready: list[CeleryWorker], broker: RedisServer, redlock_masters: ServerSet
) -> None:
    tag = uuid.uuid4().hex[:8]
    hold = {"task": "opsapp.hold"}
    acquired_before = total(ready, "redlock_acquisitions_total", outcome="acquired", **hold)
    skipped_before = total(ready, "redlock_contended_total", task="opsapp.once", policy="skip")
    refused_before = total(ready, "redlock_acquisitions_total", task="opsapp.once", outcome="held")
    latency_before = total(ready, "redlock_acquire_seconds_count", **hold)
    held_for_before = total(ready, "redlock_held_seconds_count", **hold)
    held_before = total(ready, "redlock_held_locks", **hold)
    extended_before = total(ready, "redlock_heartbeat_extensions_total", result="extended")

    long = opsapp.hold.delay(f"{tag}-long", 4.0, tag)
    started_runs(broker, tag, 1)
    # While it runs: held now, and three duplicates of it skipped.
    assert total(ready, "redlock_held_locks", **hold) == held_before + 1
    skipped = [opsapp.once.delay(f"{tag}-long", 0.0, tag) for _ in range(3)]
    for result in skipped:
        assert result.get(timeout=60)["reason"] == "held by another run"
    short = [opsapp.hold.delay(f"{tag}-{i}", 0.1, tag) for i in range(6)]
    busy = opsapp.busy.delay(f"{tag}-busy", 1.6, tag)  # extended every 0.5 s
    for result in [long, *short, busy]:
        result.get(timeout=60)

    def settled() -> bool:
        # The released signal comes after the result is stored: wait for the counters to catch up.
        return total(ready, "redlock_held_seconds_count", **hold) == held_for_before + 7

    wait_until(settled, 10, "every run's release to be counted")
    assert total(ready, "redlock_acquisitions_total", outcome="acquired", **hold) == acquired_before + 7
    assert total(ready, "redlock_acquire_seconds_count", **hold) == latency_before + 7
    assert total(ready, "redlock_contended_total", task="opsapp.once", policy="skip") == skipped_before + 3
    assert (
        total(ready, "redlock_acquisitions_total", task="opsapp.once", outcome="held") == refused_before + 3
    )
    assert total(ready, "redlock_held_locks", **hold) == held_before
    assert total(ready, "redlock_heartbeat_extensions_total", result="extended") >= extended_before + 2
    assert total(ready, "redlock_heartbeat_ttl_used_ratio_count") >= 2
    assert total(ready, "redlock_lost_total", **hold) == 0
    # At scrape time, each worker's main process asks every master.
    for worker in ready:
        samples = scrape(worker)
        up = {
            dict(labels)["master"]: v for (name, labels), v in samples.items() if name == "redlock_master_up"
        }
        assert sorted(up) == sorted(s.address for s in redlock_masters) and set(up.values()) == {1.0}
