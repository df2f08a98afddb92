"""A revoke that races with the pool's hand-off of a marked message, on real servers and a real
prefork worker: the message still runs, so its marker must still answer a call of its key.

A prefork worker's main process adds a request to ``active_requests`` only when it reads the
pool child's ACK (``Request.on_accepted``), after it has handed the job to the pool
(``execute_using_pool``, Celery's last revoked check). A revoke handled in that window does not
stop the run. A worker-side hook that deleted the markers of revoked messages "not yet active"
(tried, and withdrawn) deleted this one: the next call was published beside a message that ran,
and both ran. The window is made wide here, deterministically, by stopping the pool children
(SIGSTOP, by pid) before the message arrives.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock.testing import CeleryWorker
from tests.waiting import wait_until

from .conftest import ROOT, World


@pytest.fixture
def prefork(r27: Any, world: World) -> Iterator[tuple[CeleryWorker, str]]:
    """A real prefork worker with two pool children, on a queue of its own."""
    queue = f"r27-{uuid.uuid4().hex[:8]}"
    worker = CeleryWorker(
        "tests.review27.app",
        pool="prefork",
        concurrency=2,
        queues=[queue],
        env=world.env,
        pythonpath=[str(ROOT)],
    )
    worker.start()
    try:
        yield worker, queue
    finally:
        worker.stop()


def _reserved_not_active(r27: Any, task_id: str) -> bool:
    replies = r27.app.control.inspect(timeout=1.0).query_task(task_id) or {}
    return any(found.get(task_id, [None])[0] == "reserved" for found in replies.values())


@pytest.mark.timeout(90)
def test_a_revoke_racing_the_pool_hand_off_leaves_one_message_and_one_run(
    r27: Any, world: World, prefork: tuple[CeleryWorker, str], tag: str
) -> None:
    """``lock_contended="wait"``: the revoked message, handed to a pool child before the revoke
    arrived, runs; the next call is handed its id, not published beside it: one run."""
    worker, queue = prefork
    children = worker.child_pids()
    assert len(children) == 2
    runs = world.broker.client()
    for child in children:
        os.kill(child, signal.SIGSTOP)
    try:
        first = r27.waiting.apply_async((tag,), queue=queue)
        # The main process reserved it and (a pool slot free) handed it to the pool in the same
        # call; the stopped child has not read it, so no ACK: reserved, not active.
        wait_until(lambda: _reserved_not_active(r27, first.id), 20, "the worker to hand the job to the pool")
        replies = r27.app.control.revoke(first.id, reply=True, timeout=5.0, limit=1)
        assert replies, "the worker did not answer the revoke"
        # The worker has handled the revoke (it replied).
        again = r27.waiting.apply_async((tag,), queue=queue)
    finally:
        for child in children:
            os.kill(child, signal.SIGCONT)
    expected = 1 if again.id == first.id else 2
    wait_until(lambda: runs.llen(f"r27:runs:{tag}") >= expected, 40, f"{expected} run(s)")
    ran = [raw if isinstance(raw, str) else raw.decode() for raw in runs.lrange(f"r27:runs:{tag}", 0, -1)]
    assert again.id == first.id, (
        "the marker of a message already handed to the pool (not yet in active_requests) was "
        "deleted by its revoke; that message ran anyway, and so did the duplicate published in "
        f"its place: runs {ran} (revoked {first.id}, duplicate {again.id})"
    )
    assert ran == [first.id]
