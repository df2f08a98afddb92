"""review47: after_return's lookup through the request, in process (eager), nested runs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_redlock import Redlock


def _free(other: Redlock, key: str) -> bool:
    lock = other.lock(f"r47:{key}", ttl=5.0)
    got = lock.acquire(blocking=False)
    if got:
        lock.release()
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_inner", [False, True])
def test_nested_eager_runs_release_both(r47: Any, other47: Redlock, fail_inner: bool) -> None:
    for _ in range(5):
        outer_key, inner_key = f"o-{uuid.uuid4().hex[:8]}", f"i-{uuid.uuid4().hex[:8]}"
        r47.app.tasks["r47.outer"].apply((outer_key, inner_key, fail_inner))
        assert _free(other47, outer_key), "outer lock left held"
        assert _free(other47, inner_key), "inner lock left held"
        if fail_inner:
            assert _free(other47, inner_key + "-b")


@pytest.mark.timeout(60)
def test_same_task_id_nested_eager(r47: Any, other47: Redlock) -> None:
    """An eager inner run given the outer's task id: each run's lock is its own."""
    outer_key, inner_key = f"o-{uuid.uuid4().hex[:8]}", f"i-{uuid.uuid4().hex[:8]}"
    tid = str(uuid.uuid4())
    inner = r47.app.tasks["r47.inner"]
    r47.app.tasks["r47.failing_fast"].apply((outer_key,), task_id=tid)
    inner.apply((inner_key,), task_id=tid)
    assert _free(other47, outer_key) and _free(other47, inner_key)
