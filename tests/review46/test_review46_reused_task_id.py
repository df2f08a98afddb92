"""FINDING, fixed: after_return must find a run's lock through the run's own request, never
through the held registry, which has one entry per task id.

Two executions of one task id in one process (a fixed task_id published twice with other
arguments, on a threads pool) hold two locks; the later one's registry entry replaces the
earlier one's, and its release removes it. When the earlier run's lock is then left for
after_return to release (its before_start raised after the lock was taken: no body, so no
release as a body ends), an after_return that asked the registry first found no entry and
skipped, task_postrun skipped for the same reason, and the heartbeat kept the lock alive for the
life of the worker process."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_redlock import Redlock
from tests.waiting import wait_until

from .test_review46_after_return import ended, free_within, no_double_release

pytestmark = pytest.mark.timeout(120)


def test_one_task_id_published_twice_with_other_keys_on_the_threads_pool(
    r46: Any, threads46: Any, contender: Redlock
) -> None:
    """The same task id twice with other arguments (other keys): both run at once in the threads
    pool, and each registers its lock under the one task id. The first is refused after
    acquiring (only after_return can release it); the second ends first. Both locks must be
    free afterwards."""
    worker, queue = threads46
    first, second = f"idA-{uuid.uuid4().hex[:8]}", f"idB-{uuid.uuid4().hex[:8]}"
    fixed = uuid.uuid4().hex
    r46.refused.apply_async((first, 1.5), task_id=fixed, queue=queue)
    wait_until(lambda: r46.events(first), 20, "the first run to acquire")
    r46.ok.apply_async((second, 0.0), task_id=fixed, queue=queue)
    ended(r46, second)
    assert free_within(contender, second, 3.0)
    wait_until(lambda: "refused after acquiring" in worker.log_text(), 20, "the first run to be refused")
    assert free_within(contender, first, 5.0), (
        "the refused run's lock is still held (and kept alive by the heartbeat): after_return "
        "skipped it because the registry's entry for its task id was the other run's"
    )
    no_double_release(worker)
