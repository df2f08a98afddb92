"""A publish that reuses a task id is a new publish, not an earlier attempt of the same run.

The rule: a run that finds its own task id holding the lock waits (retries) only when the holder
belongs to the same publish (the ``redlock_publish`` header, carried by the message's broker
redeliveries and its retries). Another publish with the same explicit ``task_id`` is a
duplicate like any other, dealt with by ``lock_contended``. (A redelivered copy of a dead run,
which must wait, is tested in ``test_celery_paths.py``, with ``crash_once``.)
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from conftest import records, wait_until
from test_celery_core import Pool

from celery_redlock.celery.hooks import PUBLISH_ID_HEADER


def _refusals(lockapp: Any, tag: str) -> list[dict[str, Any]]:
    return [r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]


@pytest.mark.timeout(60)
def test_publishes_reusing_one_task_id_are_duplicates_not_attempts(
    lockapp: Any, pool: Pool, tag: str
) -> None:
    _, queue, _ = pool
    shared_id = str(uuid.uuid4())
    for _ in range(4):
        lockapp.hold_or_skip.apply_async((tag, 1.5, tag), queue=queue, task_id=shared_id)
    refusals = wait_until(lambda: _refusals(lockapp, tag)[2:] and _refusals(lockapp, tag), 20, "3 refusals")
    assert [r["policy"] for r in refusals] == ["skip", "skip", "skip"], refusals
    ran = wait_until(lambda: records(lockapp, tag), 20, "the holder's body to end")
    assert len(ran) == 1, ran  # one body, not four run one after the other
    assert len(_refusals(lockapp, tag)) == 3


@pytest.mark.timeout(60)
def test_a_copy_of_the_same_publish_waits_for_its_earlier_attempt(lockapp: Any, pool: Pool, tag: str) -> None:
    """Two messages carrying one task id and one publish id (as a broker redelivery does): the
    later is never skipped as a duplicate of the other; both bodies run, one after the other."""
    _, queue, _ = pool
    shared_id = str(uuid.uuid4())
    headers = {PUBLISH_ID_HEADER: uuid.uuid4().hex[:16]}
    for seconds in (1.0, 0.0):
        lockapp.hold_or_skip.apply_async((tag, seconds, tag), queue=queue, task_id=shared_id, headers=headers)
    ran = wait_until(lambda: records(lockapp, tag)[1:] and records(lockapp, tag), 30, "both bodies to run")
    intervals = sorted((r["start"], r["end"]) for r in ran)
    assert intervals[0][1] <= intervals[1][0], "the copies overlapped"
    assert all(r["policy"] == "retry" for r in _refusals(lockapp, tag)), _refusals(lockapp, tag)
