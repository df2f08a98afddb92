"""lock_reentrant=True on real workers (prefork 2x2 and threads), five real masters.

Invariants attacked: a service function the body calls re-enters the task's own lock through
app_redlock(app) instead of deadlocking (depth 2 inside it), duplicates never overlap, every run
ends with nothing left on the masters, and an execution's owner scope never leaks into the next
execution in the same worker thread (each run enters at depth 1, never deeper).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import holds, records, wait_until

from celery_redlock.testing import CeleryWorker, ServerSet, find_overlaps

Pool = tuple[str, str, list[CeleryWorker]]


@pytest.mark.timeout(90)
def test_the_body_reenters_its_own_lock(
    lockapp: Any, pool: Pool, tag: str, redlock_masters: ServerSet
) -> None:
    _, queue, _ = pool
    results = [lockapp.reentrant_job.apply_async((tag, tag), queue=queue) for _ in range(6)]
    for result in results:
        result.get(timeout=60)
    seen = records(lockapp, tag)
    service = [r for r in seen if r["event"] == "service"]
    intervals = [r for r in seen if r["event"] == "interval"]
    assert len(service) == len(intervals) == 6
    # Each run's service call re-entered at depth 2: never a fresh lock (depth 1, a leaked
    # scope of another run) nor deeper (a holding left over from an earlier run).
    assert [r["depth"] for r in service] == [2] * 6
    assert all(r["owned"] for r in service + intervals)
    assert find_overlaps(holds(intervals)) == []

    def nothing_left() -> bool:
        for server in redlock_masters:
            client = server.client()
            try:
                if client.exists(f"redlock:res:{tag}"):
                    return False
            finally:
                client.close()
        return True

    wait_until(nothing_left, 5, "every run's lock to be released")
