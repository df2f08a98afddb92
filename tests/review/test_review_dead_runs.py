"""A run whose pool child dies (the hard time limit, ``revoke(terminate=True, signal="SIGKILL")``)
has its terminal state stored by the worker's main process, which cannot release the child's
lock: the lock stands until its TTL after the run's completion is visible. The next step of the
same resource, published after the caller saw that completion, must not be refused by it
(contract 1: release happens-before completion; contract 3: a refusal names a holder that was
still holding)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from celery import states

from .conftest import Workers


def _wait(predicate: Any, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


KNOWN_LIMIT = (
    "known limit (docs/pools.md): a pool child killed by the worker (hard time limit, revoke "
    "with SIGKILL, the OOM killer) cannot release; the worker records its end first, and its "
    "lock lasts until its TTL"
)


@pytest.mark.timeout(90)
def test_the_next_step_after_a_hard_time_limit_is_not_refused_by_the_killed_run(
    review_app: Any, review_workers: Workers, tag: str
) -> None:
    queue = review_workers("prefork", 2)
    killed = review_app.sleeper.apply_async((tag, 30.0), queue=queue, time_limit=1.5)
    killed.get(timeout=30, propagate=False)
    assert killed.state == states.FAILURE and type(killed.result).__name__ == "TimeLimitExceeded", (
        killed.result
    )
    # The caller saw the run end; the next step of the resource is published now.
    following = review_app.sleeper.apply_async((tag, 0.0), queue=queue)
    following.get(timeout=30, propagate=False)
    assert following.state == states.SUCCESS, (
        f"the step after a run killed by its hard time limit ended {following.state}: {following.result}"
    )


@pytest.mark.xfail(
    strict=True,
    reason=KNOWN_LIMIT,
)
@pytest.mark.timeout(90)
def test_a_run_ended_by_its_hard_time_limit_is_released_before_its_failure_is_stored(
    review_app: Any, review_workers: Workers, tag: str
) -> None:
    """A body in Python code does release (SIGTERM interrupts it), but only after billiard's
    timeout handler has stored the FAILURE: the order is the wrong one every time."""
    queue = review_workers("prefork", 2)
    killed = review_app.sleeper.apply_async((tag, 30.0), queue=queue, time_limit=1.5)
    killed.get(timeout=30, propagate=False)
    assert killed.state == states.FAILURE and type(killed.result).__name__ == "TimeLimitExceeded", (
        killed.result
    )
    stored = killed.date_done.timestamp()
    _wait(lambda: any(e["event"] == "released" for e in review_app.events(tag)), 10, "the release")
    released = next(e["t"] for e in review_app.events(tag) if e["event"] == "released")
    assert released <= stored, (
        f"the lock was released {released - stored:.3f} s after the run's FAILURE was stored"
    )


@pytest.mark.xfail(
    strict=True,
    reason=KNOWN_LIMIT,
)
@pytest.mark.timeout(90)
def test_the_next_step_after_a_hard_time_limit_in_native_code_is_not_refused_by_the_killed_run(
    review_app: Any, review_workers: Workers, tag: str
) -> None:
    """The body is inside one C call when its hard limit strikes: billiard stores the FAILURE,
    sends SIGTERM, and SIGKILLs the child 0.1 s later; nothing in the child ever releases."""
    queue = review_workers("prefork", 2)
    killed = review_app.cruncher.apply_async((tag, 10**9), queue=queue, time_limit=1.5)
    killed.get(timeout=30, propagate=False)
    assert killed.state == states.FAILURE and type(killed.result).__name__ == "TimeLimitExceeded", (
        killed.result
    )
    following = review_app.sleeper.apply_async((tag, 0.0), queue=queue)
    following.get(timeout=30, propagate=False)
    assert following.state == states.SUCCESS, (
        f"the step after a run killed by its hard time limit ended {following.state}: {following.result}"
    )


def _kill_running(review_app: Any, result: Any, tag: str, how: str) -> str:
    """Kill the pool child running ``result`` (``how``): by ``revoke(terminate=True,
    signal="SIGKILL")``, or by a SIGKILL from outside (the kernel's OOM killer); the state the
    worker then records for it."""
    _wait(lambda: any(e["event"] == "start" for e in review_app.events(tag)), 30, "the body to start")
    if how == "revoke":
        result.revoke(terminate=True, signal="SIGKILL")
    else:
        child = next(e["pid"] for e in review_app.events(tag) if e["event"] == "start")
        os.kill(child, signal.SIGKILL)
    _wait(lambda: result.state in states.READY_STATES, 30, "the killed run's state to be recorded")
    return str(result.state)


@pytest.mark.xfail(
    strict=True,
    reason=KNOWN_LIMIT,
)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["revoke", "oom-kill"])
def test_the_next_step_after_a_killed_pool_child_is_not_refused_by_the_killed_run(
    review_app: Any, review_workers: Workers, tag: str, how: str
) -> None:
    """A child killed by ``revoke(terminate=True, signal="SIGKILL")`` (REVOKED) or by the OOM
    killer (FAILURE, WorkerLostError): its state is stored by the main process at once, and its
    lock stands until its TTL (20 s here)."""
    queue = review_workers("prefork", 2)
    doomed = review_app.sleeper.apply_async((tag, 30.0), queue=queue)
    state = _kill_running(review_app, doomed, tag, how)
    following = review_app.sleeper.apply_async((tag, 0.0), queue=queue)
    following.get(timeout=30, propagate=False)
    assert following.state == states.SUCCESS, (
        f"the step after a run killed ({how}, recorded {state}) ended {following.state}: {following.result}"
    )


@pytest.mark.xfail(
    strict=True,
    reason=KNOWN_LIMIT,
)
@pytest.mark.timeout(90)
def test_a_publish_after_a_revoke_with_sigkill_is_not_deduplicated_against_the_killed_run(
    review_app: Any, review_workers: Workers, tag: str
) -> None:
    """lock_enqueue="return_existing": the killed run is REVOKED, its lock stands until its TTL,
    and the next publish of the resource is handed the dead run's AsyncResult: nothing is
    published, and the caller's work is lost."""
    queue = review_workers("prefork", 2)
    doomed = review_app.deduped.apply_async((tag, 30.0), queue=queue)
    _kill_running(review_app, doomed, tag, "revoke")
    again = review_app.deduped.apply_async((tag, 0.0), queue=queue)
    assert again.id != doomed.id, f"the publish was handed the killed run's result ({doomed.state})"
    again.get(timeout=30, propagate=False)
    assert again.state == states.SUCCESS, f"{again.state}: {again.result}"
