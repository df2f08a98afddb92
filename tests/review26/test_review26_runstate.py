"""Issue 26 review: one RunState per run (celery/runstate.py), attacked for what a run may leak into
the next. The same tasks (``runsapp.py``) run eagerly here and in a real threads worker whose one
thread runs every run in turn: each run's end happens once (one ``lock_released`` per run, however
many backstops look), and a reentrant run's owner scope ends with it."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.lock.owner import current_owner
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

from ..waiting import wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
QUEUE = f"runs26-{uuid.uuid4().hex[:8]}"
MODES = ["eager", "threads"]


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def runsapp(broker: RedisServer, server_set: ServerSet) -> Iterator[ModuleType]:
    sys.path.insert(0, str(HERE))
    try:
        import runsapp as module
    finally:
        sys.path.remove(str(HERE))
    module.app.conf.update(broker_url=broker.url, result_backend=broker.url, redlock_masters=server_set.urls)
    yield module
    close_app_redlock(module.app)


@pytest.fixture(scope="module")
def worker(runsapp: ModuleType, broker: RedisServer, server_set: ServerSet) -> Iterator[CeleryWorker]:
    """One threads worker with one thread: every run it gets follows the last in that thread."""
    env = {"RUNSAPP_BROKER": broker.url, "RUNSAPP_MASTERS": ",".join(server_set.urls), "RUNSAPP_QUEUE": QUEUE}
    with CeleryWorker(
        "runsapp", pool="threads", concurrency=1, queues=[QUEUE], env=env, pythonpath=[str(HERE), str(ROOT)]
    ) as started:
        yield started


def run(runsapp: ModuleType, mode: str, request: pytest.FixtureRequest, task: Any, *args: Any) -> Any:
    if mode == "eager":
        return task.apply(args).get(propagate=False)
    request.getfixturevalue("worker")
    return task.apply_async(args, queue=QUEUE).get(timeout=30, propagate=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_each_run_ends_once_whatever_the_backstops(
    masters: ServerSet, runsapp: ModuleType, mode: str, request: pytest.FixtureRequest
) -> None:
    """A run's end releases once: the body's end does it, and the backstops that look again
    (``after_return``, ``task_postrun``) find it done. Runs that succeed, raise, retry (two runs of
    one task id) and call themselves directly (no run of its own) follow one another."""
    tag = uuid.uuid4().hex[:12]
    for n, how in enumerate(["ok", "raise", "retry", "self", "ok"]):
        outcome = run(runsapp, mode, request, runsapp.ends, tag, n, how)
        assert outcome == how or how == "raise", (how, outcome)
    runs = {f"runs26:{tag}/{n}": count for n, count in enumerate([1, 1, 2, 1, 1])}

    def per_key() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for entry in runsapp.read(tag, "released"):
            found.setdefault(entry["key"], []).append(entry["state"])
        return found

    # The last run's release is pushed by a signal after its result is readable: waited for.
    wait_for(lambda: {key: len(states) for key, states in per_key().items()} == runs, 5)
    assert {key: len(states) for key, states in per_key().items()} == runs, per_key()
    assert all(holds == [0, 0, 0] for holds in (_holding(masters, key) for key in runs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_a_reentrant_run_leaves_no_owner_scope_behind(
    masters: ServerSet, runsapp: ModuleType, mode: str, request: pytest.FixtureRequest
) -> None:
    """A reentrant run is one owner (a scope of its own); the next run in the same thread, and
    the thread itself once an eager run returned, are not that owner."""
    tag = uuid.uuid4().hex[:12]
    before = current_owner()
    first = run(runsapp, mode, request, runsapp.reentrant, tag)
    after = run(runsapp, mode, request, runsapp.plain, tag)
    second = run(runsapp, mode, request, runsapp.reentrant, tag)
    assert ":scope" in first and ":scope" in second and first != second
    assert after != first and ":scope" not in after, (first, after)
    assert current_owner() == before


def _holding(servers: ServerSet, key: str) -> list[int]:
    found = []
    for server in servers:
        client = server.client()
        try:
            found.append(int(client.exists(f"redlock:{key}")))
        finally:
            client.close()
    return found
