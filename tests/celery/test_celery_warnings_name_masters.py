"""Warnings name the masters: when a majority of masters stops answering while a run holds its
lock, the worker's warnings of a failed heartbeat extension and of an unconfirmed release say
which masters did not answer. On a real worker whose masters go through proxies the test cuts."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import HERE, ROOT

from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from celery_redlock.testing.proxy import ProxySet

CUT = (1, 2, 3)  # three of five masters: no quorum answers


@pytest.fixture(scope="module")
def proxied(
    broker: RedisServer, _redlock_server_set: ServerSet
) -> Iterator[tuple[Any, ProxySet, str, CeleryWorker]]:
    """(endsapp, the proxies, the queue, a solo worker reaching the masters through them)."""
    proxies = ProxySet([m.address for m in _redlock_server_set], name="warned").start()
    env = {"ENDS_BROKER": broker.url, "ENDS_MASTERS": ",".join(proxies.urls)}
    os.environ.update(env)
    import endsapp

    endsapp.app.conf.update(broker_url=broker.url, result_backend=broker.url)
    queue = f"ends-warned-{uuid.uuid4().hex[:8]}"
    worker = CeleryWorker(
        "endsapp", pool="solo", concurrency=None, queues=[queue], env=env, pythonpath=[str(HERE), str(ROOT)]
    )
    try:
        worker.start()
        yield endsapp, proxies, queue, worker
    finally:
        worker.cleanup()
        proxies.close()
        close_app_redlock(endsapp.app)


def _started(ends: Any, tag: str) -> None:
    deadline = time.monotonic() + 15.0
    while not any(e["event"] == "start" for e in ends.events(tag)):
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.02)


def _named(line: str, proxies: ProxySet) -> list[int]:
    """The ports of the cut masters that ``line`` does not name."""
    return [proxies[i].port for i in CUT if str(proxies[i].port) not in line]


@pytest.mark.timeout(90)
def test_the_warning_of_an_unconfirmed_release_names_the_masters(
    proxied: tuple[Any, ProxySet, str, CeleryWorker],
) -> None:
    ends, proxies, queue, worker = proxied
    tag = uuid.uuid4().hex[:10]
    result = ends.slow.apply_async((tag, 1.0), queue=queue)
    _started(ends, tag)
    for i in CUT:
        proxies[i].blackhole()
    try:
        result.get(timeout=30, propagate=False)
        line = worker.wait_for_log(rf"the release of lock e:{tag} [^\n]*", timeout=10).group(0)
    finally:
        proxies.heal()
    assert _named(line, proxies) == [], line


@pytest.mark.timeout(90)
def test_the_warning_of_a_failed_heartbeat_extension_names_the_masters(
    proxied: tuple[Any, ProxySet, str, CeleryWorker],
) -> None:
    """The lock's TTL is 10 s: extended every ~3.3 s, so a 4.5 s body sees one extension fail."""
    ends, proxies, queue, worker = proxied
    tag = uuid.uuid4().hex[:10]
    result = ends.slow.apply_async((tag, 4.5), queue=queue)
    _started(ends, tag)
    for i in CUT:
        proxies[i].blackhole()
    try:
        line = worker.wait_for_log(rf"extension of e:{tag} failed[^\n]*", timeout=15).group(0)
    finally:
        proxies.heal()
    result.get(timeout=30, propagate=False)
    assert _named(line, proxies) == [], line
