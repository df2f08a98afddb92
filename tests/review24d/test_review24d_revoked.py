"""What a revoke does to the deduplication of later calls, on real servers and a real worker: a
broker, a result backend of its own, three masters.

A revoked message's marker is deleted by the worker that holds the message (as the revoke
arrives, or when it discards it), never because a result backend says REVOKED. These tests
pin why: a publish that read the backend on the duplicate path blocked on a stopped backend,
handed out the id of a publish that had not returned, and took an earlier message's REVOKED
(a reused task id) for the live one's.

Messages go to queues nobody consumes; the one worker consumes a queue of its own, and is there
to receive the revoke broadcast and store REVOKED, as Celery's worker does for a message it does
not hold."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
from celery import signals

from celery_redlock.testing import CeleryWorker
from tests.waiting import wait_until

from .conftest import World


def _revoked_delayed(r24d: Any, tag: str) -> Any:
    """A delayed message of ``marked`` for ``tag`` (queue nobody consumes), revoked, its REVOKED
    state stored by the real worker; its marker still on the masters."""
    queue = f"r24d-nobody-{tag}"
    first = r24d.marked.apply_async((tag,), countdown=300, queue=queue)
    assert r24d.marked.queued_task_id(tag) == first.id
    r24d.app.control.revoke(first.id)
    wait_until(lambda: first.state == "REVOKED", 20, "the worker to store REVOKED")
    return first


@pytest.mark.timeout(60)
def test_a_duplicate_publish_does_not_block_on_a_stopped_result_backend(
    r24d: Any, world: World, tag: str
) -> None:
    """A publish deduplicated against a queued marker reads nothing but the masters: a result
    backend that does not answer (stopped, a failover, a partition) would block every duplicate
    ``delay()`` for its socket timeout (120 s by default with Celery's Redis backend), though the
    masters answered at once."""
    queue = f"r24d-nobody-{tag}"
    first = r24d.marked.apply_async((tag,), countdown=300, queue=queue)
    assert r24d.marked.apply_async((tag,), queue=queue).id == first.id
    got: list[Any] = []
    world.backend.pause()
    try:
        caller = threading.Thread(
            target=lambda: got.append(r24d.marked.apply_async((tag,), queue=queue).id), daemon=True
        )
        started = time.monotonic()
        caller.start()
        caller.join(5.0)
        took = time.monotonic() - started
        blocked = caller.is_alive()
    finally:
        world.backend.resume()
    caller.join(30)
    assert not blocked, (
        f"a duplicate publish blocked {took:.1f} s on the stopped result backend (the masters "
        "answered at once); it returned once the backend was resumed"
    )
    assert got == [first.id]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("after_revoke", [False, True], ids=["free-key", "after-revoke"])
def test_after_a_revoked_marker_a_call_is_not_handed_a_publish_that_has_not_returned(
    r24d: Any, revoker: CeleryWorker, tag: str, after_revoke: bool
) -> None:
    """INVARIANT (only a published message answers a duplicate, _place_settled): calls racing on
    a key whose marker names a revoked message are never handed the id of a publish that has not
    returned (here held in ``before_task_publish`` for 3 s; a slow broker, or one that fails it,
    and then no message ever carries that id). ``free-key``, the same burst on a free key, is
    the control: the calls wait for the publish to return, as documented."""
    assert revoker.running
    if after_revoke:
        _revoked_delayed(r24d, tag)
    queue = f"r24d-nobody-{tag}"
    in_publish: dict[str, float] = {}
    mutex = threading.Lock()

    def hold(sender: Any = None, headers: Any = None, **_: Any) -> None:
        task_id = (headers or {}).get("id")
        if isinstance(task_id, str):
            with mutex:
                in_publish[task_id] = time.monotonic()
            time.sleep(3.0)

    signals.before_task_publish.connect(hold, weak=False)
    results: list[tuple[str, float]] = []
    barrier = threading.Barrier(8)

    def call() -> None:
        barrier.wait()
        result = r24d.marked.apply_async((tag,), queue=queue)
        with mutex:
            results.append((result.id, time.monotonic()))

    try:
        threads = [threading.Thread(target=call, daemon=True) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        signals.before_task_publish.disconnect(hold)
    assert not any(thread.is_alive() for thread in threads), "a call did not return within 30 s"
    assert len(results) == len(threads), results
    published = set(in_publish)
    early = [
        (task_id, at - in_publish[task_id])
        for task_id, at in results
        if task_id in published and at < in_publish[task_id] + 2.5
    ]
    assert not early, (
        f"calls handed the id of a message whose publish had not returned: {early} "
        f"(the publish held 3 s; {len(results)} calls, {len(published)} published)"
    )


@pytest.mark.timeout(120)
def test_a_revoked_state_older_than_the_marker_does_not_undo_the_deduplication(
    r24d: Any, world: World, revoker: CeleryWorker, tag: str
) -> None:
    """A task id reused (an idempotency key, ``apply_async(task_id=...)``) after a revoke: the
    REVOKED state stays in the result backend (``result_expires``), while workers that did not
    see the revoke (restarted without ``--statedb``, started since) run the new message. Taking
    that REVOKED at its word would drop the live message's marker and publish the call: two
    messages for one key, both run."""
    reused = f"r24d-reused-{tag}"
    r24d.app.control.revoke(reused)  # the id's earlier message, revoked long ago
    wait_until(lambda: r24d.app.AsyncResult(reused).state == "REVOKED", 20, "REVOKED to be stored")
    queue = f"r24d-run-{tag}"
    worker = CeleryWorker(
        "tests.review24d.app",
        pool="threads",
        concurrency=1,
        queues=[queue],
        env=world.env,
        pythonpath=[str(revoker.pythonpath[0])],
    )
    worker.start()  # a worker that never saw that revoke
    try:
        first = r24d.marked.apply_async((tag,), task_id=reused, countdown=3, queue=queue)
        second = r24d.marked.apply_async((tag,), queue=queue)
        second_ran = second.id != first.id and second.get(timeout=30) == tag
        # Its (earlier) REVOKED state answers get() and stays stored: the worker's log tells.
        ran = rf"Task r24d\.marked\[{re.escape(reused)}\] succeeded"
        first_ran = bool(worker.wait_for_log(ran, timeout=30))
    finally:
        worker.stop()
    assert second.id == first.id, (
        f"the call was published beside a queued message that ran (first ran: {first_ran}, "
        f"the call's ran: {second_ran}): the message's REVOKED state was an earlier message's"
    )
