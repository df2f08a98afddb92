"""lock_contended="wait" on real workers (prefork 2x2 and threads), a real broker and five real
masters.

Invariants attacked:
- duplicates never overlap, all run, and in wait mode none of them falls back to a lock retry
  while the holder releases in time: each is woken by the release inside its worker;
- a wait that outlasts lock_wait_timeout falls back to the retry policy (lock_max_retries), and
  ends as that policy says (LockNotAcquired once the retries are spent);
- a run revoked with terminate while it waits ends, holding nothing (the next duplicate runs).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError
from conftest import holds, records, wait_until, woken_by_release

from celery_redlock import LockNotAcquired
from celery_redlock.testing import CeleryWorker, find_overlaps

Pool = tuple[str, str, list[CeleryWorker]]


@pytest.mark.timeout(90)
def test_wait_mode_duplicates_are_woken_by_the_release(lockapp: Any, pool: Pool, tag: str) -> None:
    _, queue, _ = pool
    count = 8
    started = time.monotonic()
    results = [lockapp.hold_or_wait.apply_async((tag, 0.1, tag), queue=queue) for _ in range(count)]
    for result in results:
        result.get(timeout=60)
    took = time.monotonic() - started
    intervals = sorted(records(lockapp, tag), key=lambda r: r["start"])
    assert len(intervals) == count
    assert find_overlaps(holds(intervals)) == []
    assert all(r["owned"] for r in intervals)
    # Nobody fell back to a lock retry for want of a release (its backoff is 5 s): each wait
    # ended with a release.
    assert woken_by_release(lockapp, tag, intervals) == []
    # 8 x 0.1 s back to back, plus what the handoffs and the broker add; a retry costs 5 s.
    gaps = sorted(b["start"] - a["end"] for a, b in itertools.pairwise(intervals))
    assert took < 0.1 * count + 4.0, (took, gaps)
    # While the slots last, a waiter is woken within a round or two of the release.
    assert gaps[len(gaps) // 2] < 0.25, gaps


@pytest.mark.timeout(90)
def test_a_wait_past_its_timeout_falls_back_to_the_retry_policy(lockapp: Any, pool: Pool, tag: str) -> None:
    _, queue, _ = pool
    holder = lockapp.hold.apply_async((tag, 4.0, f"{tag}-holder"), queue=queue)
    wait_until(lambda: records(lockapp, f"{tag}-holder"), 20, "the holder to start")
    waiter = lockapp.wait_briefly.apply_async((tag, tag), queue=queue)
    with pytest.raises(LockNotAcquired):
        waiter.get(timeout=30)
    assert records(lockapp, tag) == []  # its body never ran
    contended = [r for r in records(lockapp, "signals:contended") if r["key"] == f"res:{tag}"]
    # One lock retry (the first wait), then the second wait ended the run.
    assert [r["policy"] for r in contended] == ["retry", "exhausted"], contended
    holder.get(timeout=30)


@pytest.mark.timeout(90)
def test_revoke_while_waiting_ends_the_run_holding_nothing(lockapp: Any, pool: Pool, tag: str) -> None:
    """prefork: revoke with terminate kills the waiting child. threads: a plain revoke reaches
    the worker's revoked set, which the wait checks at each wake (at least every 0.5 s)."""
    name, queue, _ = pool
    # Held until the test says so: however long the control commands take under load, the
    # revoke reaches a waiter whose holder still holds.
    flag = f"{tag}-release"
    holder = lockapp.hold_until.apply_async((tag, flag, 60.0, f"{tag}-holder"), queue=queue)
    wait_until(lambda: records(lockapp, f"{tag}-holder"), 20, "the holder to start")
    waiter = lockapp.hold_or_wait.apply_async((tag, 0.1, tag), queue=queue)
    # Control commands from a process of their own: Celery's control in this process leaves
    # broker state behind that hangs the children later tests fork here (tests/core's fork tests).
    broker = lockapp.app.conf.broker_url
    wait_until(lambda: _control(broker, "active", waiter.id) == "yes", 20, "the waiter to run")
    revoked_at = time.monotonic()
    _control(broker, "revoke-terminate" if name == "prefork" else "revoke", waiter.id)
    with pytest.raises(TaskRevokedError):
        waiter.get(timeout=20)
    # Ended while the holder still held, and well before the wait's own timeout (20 s): the
    # revoke cut the wait short. (Not a tighter bound: how soon a revoke reaches a worker is the
    # broker's and the load's, and a loaded host took 4 s.)
    assert time.monotonic() - revoked_at < 10.0
    assert holder.state != "SUCCESS"
    lockapp.store().set(flag, 1)
    holder.get(timeout=30)
    assert records(lockapp, tag) == []  # the revoked run's body never ran
    # Whatever the pool did with the waiting run, a later duplicate gets the lock at once.
    later = lockapp.hold_or_wait.apply_async((tag, 0.1, f"{tag}-later"), queue=queue)
    later.get(timeout=30)
    assert [r["attempt"] for r in records(lockapp, f"{tag}-later")] == [0]


_CONTROL = """
import sys
from celery import Celery

app = Celery("wait-control", broker=sys.argv[1], set_as_current=False)
what, task_id = sys.argv[2], sys.argv[3]
if what == "active":
    active = app.control.inspect(timeout=1.0).active() or {}
    print("yes" if any(t.get("id") == task_id for ts in active.values() for t in ts) else "no")
else:
    app.control.revoke(task_id, terminate=what == "revoke-terminate")
    print("sent")
"""


def _control(broker: str, what: str, task_id: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CONTROL, broker, what, task_id], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
