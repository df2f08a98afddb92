"""A lock retry's outcome is the retried copy's, however late its run's RETRY state is stored.

Celery's own ``self.retry()`` publishes the copy before the tracer stores the RETRY state. A lock
retry done that way lets a copy that gets the lock at once finish, and store SUCCESS, before the
RETRY of the attempt before it lands, which then stands for ever: the work done, ``.get()``
waiting until its timeout. The lock retry is published once that state is stored (see
``contend.retry``); here, on a real worker whose backend stores RETRY 0.4 s late, a copy whose
body succeeds ends SUCCESS and one whose body raises ends FAILURE. (Celery's backend does not
overwrite a stored SUCCESS, only what it reads before its write; a FAILURE it overwrites.)
"""

from __future__ import annotations

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
    inspect = module.app.control.inspect(timeout=1.0)

    def idle() -> bool:
        active = inspect.active() or {}
        return bool(active) and not any(active.values())

    assert wait_for(idle, 30, every=0.05), "the worker never went idle"
    states = stored()
    assert [states[r.id] for r in contenders] == ["SUCCESS", "FAILURE"], states
