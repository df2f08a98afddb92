"""A marked run's wait for the lock ends before its hard time limit also when the masters are
slow to answer (far away, loaded): the margin left must cover the rounds, whose length is
``redlock_request_timeout``, and the time the run spent before its wait began. A real prefork
worker reaching three real masters through proxies that delay every reply."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states

from celery_redlock.testing import CeleryWorker
from celery_redlock.testing.proxy import ProxySet

from ..appservers import app_env
from .conftest import ROOT, Servers, wait_for

REPLY_DELAY = 1.2  # every master's reply reaches the worker this late
REQUEST_TIMEOUT = 2.0  # and the worker is configured to wait for it


@pytest.fixture(scope="module")
def slow_worker(r24: Any, r24_servers: Servers) -> Iterator[tuple[str, ProxySet]]:
    broker, masters = r24_servers
    proxies = ProxySet([m.address for m in masters], name="r24-slow").start()
    queue = f"r24-slow-{uuid.uuid4().hex[:8]}"
    env = app_env("R24", broker, masters)
    env["R24_MASTERS"] = ",".join(proxies.urls)
    env["R24_REQUEST_TIMEOUT"] = str(REQUEST_TIMEOUT)
    worker = CeleryWorker(
        "tests.review24c.app",
        pool="prefork",
        concurrency=2,
        queues=[queue],
        env=env,
        pythonpath=[str(ROOT)],
        cwd=str(ROOT),
    )
    try:
        worker.start()
        for proxy in proxies:
            proxy.delay(REPLY_DELAY, "down")
        yield queue, proxies
    finally:
        worker.cleanup()
        proxies.close()


@pytest.mark.timeout(120)
def test_a_marked_run_waiting_on_slow_masters_is_not_killed_by_its_hard_limit(
    r24: Any, slow_worker: tuple[str, ProxySet], tag: str
) -> None:
    """``time_limit=4`` on the call; every master answers 1.2 s late (request_timeout 2 s);
    another task holds the key for 12 s. The wait must end before the child is killed: the run
    then retries the lock, and runs once the key is free."""
    queue, _ = slow_worker
    holder = r24.slow.apply_async((tag, 12.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in r24.events(tag)), 30.0)
    waiting = r24.marked_wait.apply_async((tag,), queue=queue, time_limit=4.0)
    value = waiting.get(timeout=80, propagate=False)
    holder.get(timeout=60, propagate=False)
    # A lock retry published before the kill would still run it: its work is lost only if not.
    ran = wait_for(lambda: any(e.get("task_id") == waiting.id for e in r24.events(tag)), 15.0)
    assert ran and waiting.state == states.SUCCESS, (
        f"the waiting run ended {waiting.state}: {value!r}; its body never ran: events {r24.events(tag)}"
    )
