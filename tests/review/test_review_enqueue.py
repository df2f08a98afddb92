"""Enqueue dedup (contract 5: a marker lives as long as its message can still arrive) across a
``Reject(requeue=True)``: the run's lock is released as its body ends, and its message goes
back to the queue with nothing on the key; ``self.retry()`` hands its lock to the new message's
marker, a requeue hands it to nobody."""

from __future__ import annotations

import time
from typing import Any

import pytest

from .conftest import Workers

KNOWN_LIMIT = (
    "known limit (docs/enqueue.md): Reject(requeue=True) gives its message back unmarked, so a "
    "publish in the window before it runs again is not deduplicated"
)


@pytest.mark.xfail(
    strict=True,
    reason=KNOWN_LIMIT,
)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_message_sent_back_to_the_queue_by_reject_keeps_its_resource_queued(
    review_app: Any, review_workers: Workers, tag: str, pool: str
) -> None:
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    first = review_app.requeuer.apply_async((tag,), queue=queue)
    deadline = time.monotonic() + 30
    while not any(e["event"] == "rejected" for e in review_app.events(tag)):
        assert time.monotonic() < deadline, "the first try never ended rejected"
        time.sleep(0.02)
    try:
        queued = review_app.requeuer.is_queued(tag)
        again = review_app.requeuer.apply_async((tag,), queue=queue)
    finally:
        review_app.records().set(f"go:{tag}", 1)
    first.get(timeout=30, propagate=False)
    assert queued, "the resource of a message going back to the queue is not queued"
    assert again.id == first.id, (
        "a publish while the rejected message goes back to the queue was published too"
    )
