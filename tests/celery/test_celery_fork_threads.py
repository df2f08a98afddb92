"""No thread of ours is alive in a prefork worker's main process when it forks a pool child.

A child of ``fork`` starts with one thread: a mutex another thread of the parent held at that
moment stays held in the child for ever. Python 3.12 and later warn of it at each such fork
("This process is multi-threaded, use of fork() may lead to deadlocks in the child"); 3.10 and
3.11 say nothing, so the test asks the process itself: ``forkthreadsapp`` records, in an
``os.register_at_fork(before=...)`` hook, the threads alive at every fork of the worker's main
process (the metrics server's process, the pool's first children, and one replacement child
per task: ``worker_max_tasks_per_child=1``). The worker runs with the metrics served, which once
kept a serving thread in the main process, and with DeprecationWarnings shown: CI runs this file
on 3.12 too (.ci/run's newer-Pythons step), where the log must not carry the warning.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HERE, ROOT, RUN, wait_until

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet, free_port
from celery_redlock.testing.celery import CeleryProcessError

# CI runs this file on 3.12 and 3.13 too (.ci/run, step 3).
pytestmark = [pytest.mark.timeout(120), pytest.mark.versions]

WARNING = "is multi-threaded, use of fork() may lead to deadlocks"
TASKS = 3


def _ours(name: str) -> bool:
    """A thread the package starts: each is named ``redlock-...``; prometheus-client's server
    thread (served by the package when ``redlock_metrics`` names a port) is named after its
    target."""
    return name.startswith("redlock") or "serve_forever" in name


def _env(broker: RedisServer, masters: ServerSet, record: Path, metrics: int, queue: str) -> dict[str, str]:
    return {
        "FORKAPP_BROKER": broker.url,
        "FORKAPP_MASTERS": ",".join(masters.urls),
        "FORKAPP_RECORD": str(record),
        "FORKAPP_METRICS": str(metrics),
        "FORKAPP_QUEUE": queue,
        "PYTHONWARNINGS": "always::DeprecationWarning",
    }


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def forkapp(
    broker: RedisServer, redlock_masters: ServerSet, tmp_path: Path
) -> Iterator[tuple[Any, CeleryWorker, Path, int]]:
    """(the app module, its running prefork worker, the fork record, the metrics port)."""
    record = tmp_path / "forks.jsonl"
    port = free_port()
    env = _env(broker, redlock_masters, record, port, f"q-forkthreads-{RUN}")
    worker = CeleryWorker(
        "forkthreadsapp",
        pool="prefork",
        concurrency=2,
        queues=[env["FORKAPP_QUEUE"]],
        env=env,
        pythonpath=[str(HERE), str(ROOT)],
        log_dir=tmp_path,
    )
    # Imported here without FORKAPP_RECORD: only the worker records its forks.
    import forkthreadsapp

    forkthreadsapp.app.conf.update(
        broker_url=broker.url, result_backend=broker.url, task_default_queue=env["FORKAPP_QUEUE"]
    )
    try:
        worker.start()
        yield forkthreadsapp, worker, record, port
    finally:
        worker.stop()


def test_no_thread_of_ours_is_alive_when_the_worker_forks(
    forkapp: tuple[Any, CeleryWorker, Path, int],
) -> None:
    app, worker, record, port = forkapp
    # Long enough for each child's heartbeat to extend its lock (TTL 5 s: every 1.67 s).
    results = [app.hold.delay(f"{RUN}-{i}", 2.0) for i in range(TASKS)]
    assert len({result.get(timeout=60) for result in results}) == TASKS  # one child per task
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"redlock_acquisitions_total" in response.read()

    # The metrics server's process, the first two pool children, a replacement per task.
    def forks() -> list[dict[str, Any]]:
        lines = record.read_text().splitlines() if record.exists() else []
        found = [json.loads(line) for line in lines]
        return found if len(found) >= 1 + 2 + TASKS else []

    seen = wait_until(forks, 30, f"{1 + 2 + TASKS} forks of the worker's main process")
    assert {fork["pid"] for fork in seen} == {worker.pid}, seen
    ours = [fork["threads"] for fork in seen if any(_ours(name) for name in fork["threads"])]
    assert not ours, f"threads of ours alive at a fork of the worker: {ours}"
    # Celery's and kombu's own: none in a prefork main process over a Redis broker (celery 5.3
    # and later), so every fork is single-threaded, and on 3.12+ nothing warns.
    assert all(fork["threads"] == ["MainThread"] for fork in seen), seen
    if sys.version_info >= (3, 12):
        assert WARNING not in worker.log_text(), worker.log_tail()


def test_the_metrics_process_ends_with_the_worker(forkapp: tuple[Any, CeleryWorker, Path, int]) -> None:
    _, worker, _, port = forkapp
    assert worker.pid is not None

    def three_children() -> list[int]:
        found = worker.descendant_pids()
        return found if len(found) == 3 else []

    children = wait_until(three_children, 10, "the two pool children and the metrics server's process")
    os.kill(worker.pid, signal.SIGTERM)  # the main process only: its warm shutdown stops the rest
    wait_until(lambda: not any(_alive(pid) for pid in [worker.pid, *children]), 30, "the worker to end")
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


@pytest.mark.timeout(60)
def test_a_metrics_port_in_use_stops_the_worker_at_start(
    broker: RedisServer, redlock_masters: ServerSet, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = CeleryWorker(
            "forkthreadsapp",
            pool="prefork",
            concurrency=1,
            env=_env(broker, redlock_masters, tmp_path / "forks.jsonl", port, f"q-forkthreads-taken-{RUN}"),
            pythonpath=[str(HERE), str(ROOT)],
            log_dir=tmp_path,
        )
        try:
            with pytest.raises(CeleryProcessError):
                worker.start(timeout=30)
            deadline = time.monotonic() + 10
            while worker.running and time.monotonic() < deadline:
                time.sleep(0.05)
            assert worker.returncode not in (None, 0)
            assert f"the worker cannot start: metrics server on *:{port}" in worker.log_text()
        finally:
            worker.stop()
