"""A retry's outcome is the retried copy's, however late its run's RETRY state is stored.

Celery's own ``self.retry()`` publishes the copy before the tracer stores the RETRY state. A
copy that gets the lock at once can finish, and store SUCCESS, before the RETRY of the run before
it lands, which then stands for ever: the work done, ``.get()`` waiting until its timeout. A lock
retry publishes its copy once that state is stored (see ``contend.retry``); a run whose body
retries keeps its lock until then (see task.py's INVARIANT), so its copy, published early,
waits. Here, on a real worker whose backend writes RETRY 0.4 s after reading what was stored, a
copy whose body succeeds ends SUCCESS and one whose body raises ends FAILURE.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_for
from retryconf import retry_app as retry_app
from retryconf import start_worker


@pytest.fixture(scope="module")
def slow_store_worker(retry_app: tuple[Any, dict[str, str]]) -> Iterator[tuple[Any, str]]:
    module, env = retry_app
    worker, queue = start_worker(env, "threads", 8, RETRY_STORE_DELAY="0.4")
    try:
        yield module, queue
    finally:
        worker.stop()


def idle(module: Any) -> bool:
    """Whether the worker runs nothing (its runs' stores have all landed)."""
    active = module.app.control.inspect(timeout=1.0).active() or {}
    return bool(active) and not any(active.values())


@pytest.mark.timeout(90)
def test_a_lock_retry_is_not_overwritten_by_the_late_retry_state_of_the_attempt_before(
    slow_store_worker: tuple[Any, str],
) -> None:
    module, queue = slow_store_worker
    key = uuid.uuid4().hex[:8]
    holder = module.step.apply_async((key, 0.3), queue=queue)
    # The holder's run has started (its lock is taken) before the contenders are published.
    assert wait_for(lambda: holder.id in module.runs(key), 30), "the holder's run never started"
    contenders = [module.step.apply_async((key, 0.0, fail), queue=queue) for fail in (False, True)]
    assert holder.get(timeout=30) == key

    def stored() -> dict[str, str]:
        return {r.id: module.stored_state(r.id) for r in contenders}

    assert wait_for(lambda: all(s in ("SUCCESS", "FAILURE") for s in stored().values()), 30), stored()
    # Every store has landed once the worker runs nothing: a copy that finished before the late
    # RETRY of the attempt before it would read RETRY from then on.
    assert wait_for(lambda: idle(module), 30, every=0.05), "the worker never went idle"
    states = stored()
    assert [states[r.id] for r in contenders] == ["SUCCESS", "FAILURE"], states


@pytest.mark.timeout(90)
def test_a_bodys_own_retry_is_not_overwritten_by_its_late_retry_state(
    slow_store_worker: tuple[Any, str],
) -> None:
    """``own_retry`` calls ``self.retry(countdown=0)`` once; its copy, published before the body
    raised and free to run at once on another thread, must not finish before the RETRY has been
    written."""
    module, queue = slow_store_worker
    keys = [uuid.uuid4().hex[:8] for _ in range(3)]
    results = [module.own_retry.apply_async((key, 0.0), queue=queue) for key in keys]
    assert [r.get(timeout=30) for r in results] == keys
    assert wait_for(lambda: idle(module), 30, every=0.05), "the worker never went idle"
    for key, result in zip(keys, results, strict=True):
        assert module.runs(key) == [result.id, result.id], module.runs(key)
    states = {r.id: module.stored_state(r.id) for r in results}
    assert set(states.values()) == {"SUCCESS"}, states


@pytest.mark.timeout(90)
def test_a_retry_the_body_swallows_still_runs_once(
    slow_store_worker: tuple[Any, str],
) -> None:
    """A body that catches the ``Retry`` its ``self.retry()`` raised ends SUCCESS, its lock
    released as it ends: the copy Celery published runs, once."""
    module, queue = slow_store_worker
    key = uuid.uuid4().hex[:8]
    result = module.own_retry_swallowed.apply_async((key,), queue=queue)
    assert wait_for(lambda: len(module.runs(key)) == 2, 30, every=0.05), module.runs(key)
    assert wait_for(lambda: idle(module), 30, every=0.05), "the worker never went idle"
    time.sleep(0.5)  # a copy published twice would have run by now
    assert module.runs(key) == [result.id, result.id]
