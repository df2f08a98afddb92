"""Attacks on a lock retry held back until its run's RETRY state is stored.

Celery's tracer (``Info.handle_retry``) runs ``mark_as_retry``, then ``task.on_retry``, then
sends ``task_retry``, where ``hooks.publish_lock_retry`` publishes the held-back copy. Anything
that raises before the signal (a result backend that is down, a user's ``on_retry``) skips it;
the copy must then still be published as the run ends (``task_postrun``), as Celery's own
``self.retry()`` would have published it. And the copy is published once: a body's own
``self.retry()`` is not published twice, ignore_result stores nothing, a chain keeps its next
step.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from conftest import wait_for
from retryconf import retry_app as retry_app
from retryconf import start_worker

from celery_redlock.testing import free_port


def hold_then_contend(module: Any, task: Any, queue: str, key: str, hold: float = 2.0) -> tuple[Any, Any]:
    holder = task.apply_async((key, hold), queue=queue)
    assert wait_for(lambda: holder.id in module.runs(key), 30), "the holder never ran"
    contender = task.apply_async((key, 0.0), queue=queue)
    return holder, contender


@pytest.mark.timeout(90)
@pytest.mark.parametrize("skipped_by", ["on-retry-raises", "backend-down"])
def test_a_lock_retry_is_published_although_its_retry_signal_is_never_sent(
    retry_app: tuple[Any, dict[str, str]], skipped_by: str
) -> None:
    module, env = retry_app
    """Celery sends no task_retry when the RETRY store raises (a result backend that is down) or
    the user's on_retry does: the held-back copy is still published, by task_postrun."""
    if skipped_by == "backend-down":
        task, extra = module.step, {"RETRY_BACKEND": f"redis://127.0.0.1:{free_port()}/0"}
    else:
        task, extra = module.step_on_retry_raises, {}
    worker, queue = start_worker(env, "threads", 4, **extra)
    try:
        key = uuid.uuid4().hex[:8]
        holder, contender = hold_then_contend(module, task, queue, key)
        assert wait_for(lambda: contender.id in module.runs(key), 20, every=0.05), (
            f"the contended run never ran again: runs={module.runs(key)}, holder={holder.id}, "
            f"contender={contender.id} state={module.stored_state(contender.id)}"
        )
    finally:
        worker.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_lock_retries_own_retry_ignore_result_and_chain_run_once(
    retry_app: tuple[Any, dict[str, str]], pool: str
) -> None:
    """What is fine: under prefork a lock retry runs its copy once; the body's own self.retry()
    after lock retries is not published twice; ignore_result works; a chain keeps its next step."""
    from celery import chain

    module, env = retry_app
    worker, queue = start_worker(env, pool, 2 if pool == "prefork" else 8)
    try:
        k1, k2, k3 = (uuid.uuid4().hex[:8] for _ in range(3))
        h1 = module.step.apply_async((k1, 1.5), queue=queue)
        assert wait_for(lambda: h1.id in module.runs(k1), 30)
        c1 = module.own_retry.apply_async((k1, 0.0), queue=queue)
        assert c1.get(timeout=30) == k1
        h2 = module.step_ignored.apply_async((k2, 1.5), queue=queue)
        assert wait_for(lambda: h2.id in module.runs(k2), 30)
        c2 = module.step_ignored.apply_async((k2, 0.0), queue=queue)
        h3 = module.step.apply_async((k3, 1.5), queue=queue)
        assert wait_for(lambda: h3.id in module.runs(k3), 30)
        c3 = chain(
            module.step.si(k3, 0.0).set(queue=queue), module.after.s(k3).set(queue=queue)
        ).apply_async()
        assert c3.get(timeout=30) == k3
        assert wait_for(lambda: c2.id in module.runs(k2), 30)
        time.sleep(2.0)  # anything published twice has run by now
        assert module.runs(k1) == [h1.id, c1.id, c1.id]
        assert module.runs(k2) == [h2.id, c2.id]
        assert module.runs(k3) == [h3.id, c3.parent.id, f"after:{k3}"]
        assert module.stored_state(c1.id) == "SUCCESS"
        assert module.stored_state(c2.id) == "PENDING"  # ignore_result: nothing stored
    finally:
        worker.stop()
